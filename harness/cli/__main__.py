from harness.cli.app import main

raise SystemExit(main())
