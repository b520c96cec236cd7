"""A run's record on disk: the name of every file in its directory, in one place.

Every run leaves a record under this user's private directory (``history.record_directory``):
the owner of the run writes ``record.json`` and, for a detached run, rank 0's value; a detached
run's supervising process (``supervise.supervisor``) writes its job, options, journal and
markers there too; a kernel that attaches (``handles.attach``) reads them.  Each side names a
file by these constants, never by its own string."""

#: the run's record (``history.RunRecord``), rewritten as the run goes
RECORD_FILE = "record.json"
#: a detached run's control socket's token, kept while its supervising process runs
TOKEN_FILE = "token"
#: a detached run's rank 0 value in its record, and what is left once it was taken or expired
VALUE_FILE = "value.blob"
VALUE_TAKEN_FILE = "value-taken"
VALUE_EXPIRED_FILE = "value-expired"
#: what the kernel hands a detached run's supervising process in files: the job as the ranks
#: read it, and the options
JOB_FILE = "job.bin"
OPTIONS_FILE = "options.json"
JOURNAL_FILE = "journal.jsonl"
JOURNAL_FULL_FILE = "journal-full"
#: in the directory of a run whose kernel follows it (``--channel process``): no journal
NO_JOURNAL_FILE = "no-journal"
#: in the directory of a run that keeps no journal: each rank's complete output once it ended
FULL_LOGS_DIR = "full-logs"
#: in it: per rank, where each attempt's output begins and where the last one ends (bytes)
FULL_LOGS_INDEX = "attempts.json"
READY_FILE = "ready"
REFUSED_FILE = "refused"
DONE_FILE = "done"
LOG_FILE = "supervisor.log"
