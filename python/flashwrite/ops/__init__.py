"""Operator tools behind the ``flashwrite`` command: ls, inspect, diff, convert, tune.

Each module does one job and returns plain data; ``common`` turns that data into
a table or JSON and errors into a message and an exit code (0 ok, 1 problem,
2 usage), never a traceback.
"""
