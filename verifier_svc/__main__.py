from verifier_svc.server import main

main()
