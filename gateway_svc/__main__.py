from gateway_svc.server import main

main()
