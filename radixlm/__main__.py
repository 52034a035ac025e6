from radixlm.cli import main

raise SystemExit(main())
