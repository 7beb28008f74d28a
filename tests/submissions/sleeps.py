"""custom_kernel writes its process id to the file named by EVAL_TEST_READY, then sleeps: the
Ctrl-C test interrupts it there."""
import os
import time
from pathlib import Path


def custom_kernel(data):
    ready = Path(os.environ["EVAL_TEST_READY"])
    partial = ready.with_name(ready.name + ".partial")
    partial.write_text(str(os.getpid()))
    partial.replace(ready)  # the file appears whole: the test reads it as soon as it exists
    time.sleep(600)
