"""A request's lifecycle, once, for the testbed and the simulator (DESIGN.md section 10).

request.py  the sequence: match, route, plan, allocate, load, prefill, decode, write back, retry
prefill.py  each PE's passes, packed under the compute quota (chunking the request that overflows)
steps.py    what the lifecycle asks of an executor, and what each step gives back
index.py    what the store holds, as the frontend counts hits
record.py   the record of one request
drive.py    running the lifecycle with asyncio (testbed/cluster/conductor.py) or in a SimPy
            process (simulator/cluster.py)
"""
