import sys

from . import render_index

sys.stdout.write(render_index())
