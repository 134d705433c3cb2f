"""Starting a job's ranks: the world communicator (init), each rank's device and node, the
supervisor that names a rank that dies, fail-fast abort."""
