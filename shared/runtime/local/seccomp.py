"""The sandbox's seccomp filter: which system calls its processes may make.

An allowlist in the spirit of Docker's default profile (the comparison every user makes),
stricter where a coding sandbox needs less:

- everything libseccomp knows that is not allowed below fails with ``EPERM``; a system
  call newer than this libseccomp fails with ``ENOSYS`` (so libc falls back to an older
  one, as runc does);
- never allowed, whatever the capabilities inside: io_uring, keyrings, bpf,
  perf_event_open, userfaultfd, ptrace and cross-process memory access (the executor's
  entered processes and bwrap's init must not be taken over), kexec and modules, the
  mount API, pivot_root, setns, quotactl, swap, reboot, clock setting, NUMA policy,
  open_by_handle_at, sethostname;
- ``clone`` without namespace flags only, ``clone3`` answers ``ENOSYS`` (its flags are in
  memory a filter cannot read, so libc falls back to ``clone``), ``unshare`` without
  namespace flags only, ``personality`` only the harmless personas;
- sockets: Unix, IPv4, IPv6 and netlink's routing and socket-diagnostics families only
  (no AF_PACKET, AF_VSOCK, AF_ALG, netfilter or generic netlink);
- only this machine's native ABI: a 32-bit or x32 system call kills the process.

It is applied by bwrap to the sandbox's init and main process, and by the runtime to
every process it enters later (``enter.py``), after the entry itself: nothing in a
sandbox runs unfiltered. ``compile_bpf`` turns the policy into the kernel's program once
per process.
"""

from __future__ import annotations

import errno
import functools
import tempfile

ALLOWED = frozenset(
    """
    accept accept4 access adjtimex alarm arch_prctl bind brk capget capset chdir chmod chown
    chroot clock_getres clock_gettime clock_nanosleep close close_range connect
    copy_file_range creat dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_pwait
    epoll_pwait2 epoll_wait eventfd eventfd2 execve execveat exit exit_group faccessat
    faccessat2 fadvise64 fallocate fanotify_mark fchdir fchmod fchmodat fchmodat2 fchown
    fchownat fcntl fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat
    fstatfs fsync ftruncate futex futex_waitv futex_wake futex_wait futex_requeue futimesat
    getcpu getcwd getdents getdents64 getegid geteuid getgid getgroups getitimer getpeername
    getpgid getpgrp getpid getppid getpriority getrandom getresgid getresuid getrlimit
    get_robust_list getrusage getsid getsockname getsockopt get_thread_area gettid
    gettimeofday getuid getxattr inotify_add_watch inotify_init inotify_init1
    inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents ioprio_get
    ioprio_set io_setup io_submit kill landlock_add_rule landlock_create_ruleset
    landlock_restrict_self lchown lgetxattr link linkat listen listxattr llistxattr
    lremovexattr lseek lsetxattr lstat madvise membarrier memfd_create mincore mkdir mkdirat
    mknod mknodat mlock mlock2 mlockall mmap modify_ldt mprotect mq_getsetattr mq_notify
    mq_open mq_timedreceive mq_timedsend mq_unlink mremap msgctl msgget msgrcv msgsnd msync
    munlock munlockall munmap name_to_handle_at nanosleep newfstatat open openat openat2 pause
    pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll
    prctl pread64 preadv preadv2 prlimit64 process_mrelease pselect6 pwrite64 pwritev
    pwritev2 read readahead readlink readlinkat readv recvfrom recvmmsg recvmsg
    remap_file_pages removexattr rename renameat renameat2 restart_syscall rmdir rseq
    rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend
    rt_sigtimedwait rt_tgsigqueueinfo sched_getaffinity sched_getattr sched_getparam
    sched_get_priority_max sched_get_priority_min sched_getscheduler sched_rr_get_interval
    sched_setaffinity sched_setattr sched_setparam sched_setscheduler sched_yield seccomp
    select semctl semget semop semtimedop sendfile sendmmsg sendmsg sendto setfsgid setfsuid
    setgid setgroups setitimer setpgid setpriority setregid setresgid setresuid setreuid
    setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address setuid
    setxattr shmat shmctl shmdt shmget shutdown sigaltstack signalfd signalfd4 socketpair
    splice stat statfs statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill
    time timer_create timer_delete timer_getoverrun timer_gettime timer_settime
    timerfd_create timerfd_gettime timerfd_settime times tkill truncate umask uname unlink
    unlinkat utime utimensat utimes vfork vmsplice wait4 waitid write writev
    """.split()
)
"""Allowed with any arguments."""

NAMESPACE_FLAGS = 0x7E020000 | 0x80
"""CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET, and CLONE_NEWTIME (0x80,
``unshare`` only: for ``clone`` those bits are the exit signal)."""
CLONE_NAMESPACE_FLAGS = 0x7E020000
PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
"""PER_LINUX, PER_LINUX32, UNAME26 (and with PER_LINUX32), and the query."""
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
AF_NETLINK = 16
NETLINK_PROTOCOLS = (0, 4)  # NETLINK_ROUTE (ip, getaddrinfo), NETLINK_SOCK_DIAG (ss)
UNKNOWN_BELOW = 512
"""System call numbers below this that libseccomp cannot name get ENOSYS."""

MUST_DENY = (
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev",
    "kcmp", "pidfd_getfd", "process_madvise", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "mount", "umount2", "pivot_root", "fsopen", "fsmount",
    "fsconfig", "fspick", "open_tree", "move_mount", "mount_setattr", "setns",
    "open_by_handle_at", "quotactl", "quotactl_fd", "swapon", "swapoff", "reboot", "acct",
    "settimeofday", "clock_settime", "clock_adjtime", "sethostname", "setdomainname", "syslog",
    "iopl", "ioperm", "mbind", "set_mempolicy", "get_mempolicy", "move_pages", "migrate_pages",
    "fanotify_init", "lookup_dcookie", "vhangup", "uselib", "_sysctl", "ustat", "sysfs",
)  # fmt: skip
"""Refused whatever else changes here (the security tests call each one)."""


def _rules() -> object:
    import pyseccomp as sc

    assert not set(MUST_DENY) & ALLOWED, "a must-deny system call is in the allowlist"
    flt = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    flt.set_attr(sc.Attr.CTL_NNP, 0)  # the loader sets no-new-privileges itself
    arch = sc.system_arch()
    for number in range(UNKNOWN_BELOW):  # newer than this libseccomp: ENOSYS, libc falls back
        try:
            sc.resolve_syscall(arch, number)
        except ValueError:
            flt.add_rule(sc.ERRNO(errno.ENOSYS), number)
    for name in sorted(ALLOWED):
        try:
            flt.add_rule(sc.ALLOW, name)
        except (ValueError, OSError):  # not a system call on this architecture
            continue
    # Conditional rules: what does not match falls to the default (EPERM).
    flt.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NAMESPACE_FLAGS, 0))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    flt.add_rule(sc.ALLOW, "unshare", sc.Arg(0, sc.MASKED_EQ, NAMESPACE_FLAGS, 0))
    for persona in PERSONAS:
        flt.add_rule(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
    for family in SOCKET_FAMILIES:
        flt.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, family))
    for protocol in NETLINK_PROTOCOLS:
        flt.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, protocol))
    return flt


@functools.cache
def compile_bpf() -> bytes:
    """The filter as the kernel's BPF program (an array of ``struct sock_filter``)."""
    flt = _rules()
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)  # type: ignore[attr-defined]  # pyseccomp's stub omits it; libseccomp has it
        out.seek(0)
        return out.read()
