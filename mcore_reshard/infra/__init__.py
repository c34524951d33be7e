"""What the local job stands on: free ports, how its processes begin (``procs``), tiny
checkpoints made on this machine (``checkpoint``)."""
