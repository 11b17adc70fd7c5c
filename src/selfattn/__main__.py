from selfattn.cli import main

main()
