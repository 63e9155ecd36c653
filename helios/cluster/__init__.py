"""Scale-out on Ray Serve (the `cluster` extra): many engine replicas behind one helios frontend.

docs/architecture.md "Scale-out" says why the frontend binds the endpoint itself and reaches
its engines through Ray Serve handles routed by prefix affinity.
"""
