"""``python -m pagedllm.executor.process_main FD FD NAME``: a child started by ``process.ChildProcess``
(a module of its own, so that ``process`` is imported once, under its own name)."""
import sys

from pagedllm.executor.process import child_main

if __name__ == "__main__":
    child_main(sys.argv[1:])
