from .quickstart import main

main()
