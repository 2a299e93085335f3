"""The ``replay`` command line: thin commands over the library (parse, call, render)."""
