"""`python -m msjax.sweep`: compile and run the train step on several meshes and compare them.

The sweep lives in `msjax.planner.sweep`.
"""

from msjax.planner.sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
