from specmesh.cli import main

main()
