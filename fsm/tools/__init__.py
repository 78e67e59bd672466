"""Tools and their containment: the tool set a spec declares and how a call is made and answered (base), the
lanes a call runs in, inline, in a thread or in a worker process (isolation; the process lane in processes, its
worker in worker), and the loop in a thread with the batched hand-offs between a lane and the event loop
(loopthread).

May import fsm.spec, fsm.data and fsm.families; never the driver (fsm.run).
"""
