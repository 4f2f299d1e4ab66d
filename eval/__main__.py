"""``python -m eval``: run the eval stage (``make eval``)."""

from eval import main

if __name__ == "__main__":
    main()
