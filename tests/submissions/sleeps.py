"""custom_kernel writes its process id to the file named by EVAL_TEST_READY, then sleeps: the
Ctrl-C test interrupts it there."""
import os
import time
from pathlib import Path


def custom_kernel(data):
    Path(os.environ["EVAL_TEST_READY"]).write_text(str(os.getpid()))
    time.sleep(600)
