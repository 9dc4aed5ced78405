from dsv41.cli import main

raise SystemExit(main())
