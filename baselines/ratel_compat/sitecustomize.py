"""Run by `site` at the start of every Python process whose path has this directory (Ratel's, only)."""
import faulthandler
import signal

import ratel_patches

ratel_patches.install()
# the suite's runner asks a late point's processes where they are (suite/runner.py); without a
# handler SIGUSR1 would end Ratel's processes without a word
faulthandler.register(signal.SIGUSR1, all_threads=True)
