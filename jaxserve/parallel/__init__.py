"""Many devices and processes: the mesh and its sharding rules, distributed processes, the step wire, pipeline stages."""
