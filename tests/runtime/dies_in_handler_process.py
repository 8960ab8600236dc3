"""A handler module that kills any handler process importing it (the worker's own
import survives): every run dies before its handler is called."""

import multiprocessing
import os

if multiprocessing.parent_process() is not None:
    os._exit(3)


def handle(batch, ctx):
    raise AssertionError("never called in a handler process")
