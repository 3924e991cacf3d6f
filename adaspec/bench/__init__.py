"""The bench: a client of the runtime that runs real requests through every arm side by side
(``run``), turns the records into figures and verdicts (``statistics``), draws them
(``plot``), and decodes the plain baseline with the target alone (``plain``). Nothing below
the command line imports it."""
