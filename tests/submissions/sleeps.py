"""custom_kernel writes the file named by EVAL_TEST_READY, then sleeps: for Ctrl-C."""
import os
import time
from pathlib import Path


def custom_kernel(data):
    Path(os.environ["EVAL_TEST_READY"]).write_text("ready")
    time.sleep(600)
