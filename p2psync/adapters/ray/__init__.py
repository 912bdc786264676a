"""Jobs run as Ray actors: the job's rendezvous as a named detached actor that trainers and
engines find by name, holding the job's token."""

from .rendezvous import RAY, job_rendezvous, rendezvous_at

__all__ = ["RAY", "job_rendezvous", "rendezvous_at"]
