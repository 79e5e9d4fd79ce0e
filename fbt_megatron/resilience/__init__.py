"""A run that looks after itself: injected faults for drills (``faults``), the hang watchdog
(``watchdog``), loss spikes (``spikes``), and the attempts of a Slurm job with their retry budget
(``attempts``)."""
