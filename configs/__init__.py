"""Shipped configurations, installed as `dsv41.configs`; load them with `dsv41.load_config(NAME)`."""
