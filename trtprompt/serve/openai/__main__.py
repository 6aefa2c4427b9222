from trtprompt.serve.openai.server import main

raise SystemExit(main())
