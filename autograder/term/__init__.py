"""A term's logistics: the course settings, the roster and due dates, submissions taken in, the
dry run's example class, and cleaning up."""
