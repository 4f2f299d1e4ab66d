"""``python -m pipeline.verifier``: run the verifier stage (``make verifier``)."""

from pipeline.verifier import main

if __name__ == "__main__":
    main()
