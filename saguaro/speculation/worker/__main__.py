from saguaro.speculation.worker.server import main

main()
