"""`python -m msjax.plan`: memory, traffic and step time of every mesh for N devices, without them.

The planner lives in `msjax.planner.plan`.
"""

from msjax.planner.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
