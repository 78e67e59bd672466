"""Tools and their containment: the tool set a spec declares and how a call is made and answered (base), the
lanes a call runs in, inline, in a thread or in a worker process, with the loop in a thread and the batched
hand-offs between a lane and the event loop (isolation; the process lane and its worker in processes).

May import fsm.spec, fsm.data and fsm.families; never the driver (fsm.run).
"""
