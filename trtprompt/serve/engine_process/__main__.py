from trtprompt.serve.engine_process.server import main

main()
