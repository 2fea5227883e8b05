from pdserve_router.cli import main

main()
