"""Recovery: `ledger verify`, snapshots, `ledger rebuild` and the planner
(docs/recovery.md).

- `plan.py`: the planner, its verdicts and manifest; pure.
- `snapshots.py`: what a snapshot holds and how its digest is made; pure.
- `store.py`: the SQL.
- `walk.py`: the hash chain walked over ranges of the log, here or in a helper process.
- `rebuild.py`: assess, plan, rebuild and snapshot; the server's guard.
- `verify.py`: the whole log against its chain and the projections against a replay.
"""
