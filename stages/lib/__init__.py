"""Plumbing that knows no params schema: errors and the command line, files written whole, YAML
read strictly, image decoding with its limits, password masking, pip's progress line."""
