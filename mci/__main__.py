from mci.cli import main

raise SystemExit(main())
