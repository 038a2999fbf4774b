"""The `trt-builder` command line: parses options and prints; the work is in the library."""
