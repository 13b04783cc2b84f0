"""``python -m trajstore``: the command line."""

from trajstore.cli import main

if __name__ == "__main__":
    main()
