"""Errors raised for bad user input (configs, overrides, files)."""


class ConfigError(ValueError):
    """A configuration value breaks a rule.

    The message always names the field (a dotted path), the value found and what was expected.
    """

    def __init__(self, field: str, value, expected: str):
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"config field '{field}' = {value!r}: {expected}")
