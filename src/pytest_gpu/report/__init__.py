"""What the run tells its user: the terminal summary, the timeline of leases, the Perfetto
trace and the Gantt chart."""
