from .recipes.quickstart import main

main()
