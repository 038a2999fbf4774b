"""The framework every part stands on: typed errors, atomic files, digests, the layout of the engines root, locks, tool versions, dtypes, and the stage protocol with its derived cache keys."""
