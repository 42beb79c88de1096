"""Pipeline parallelism: schedules as data, a simulator, traces, transports and the event-loop engine."""
