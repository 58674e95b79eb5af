"""The ranks of a job: how they start (a launcher's, or forked here), are supervised, stop
together on a signal or a fault, agree on what went wrong, and on which device each trains."""
