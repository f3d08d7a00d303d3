"""python -m mok_proto.results --markdown | --readme | --write: see mok_proto.results.report."""

import sys

from mok_proto.results.report import main

sys.exit(main())
