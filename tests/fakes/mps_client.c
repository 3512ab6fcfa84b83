/*
 * A compiled front for the fake nvidia-cuda-mps-control (tests/fakes/
 * nvidia-cuda-mps-control, Python): client invocations are answered here,
 * as cheaply as the real binary's (about 1 ms of CPU instead of the 25-100 ms
 * a Python interpreter start costs); every other invocation is handed to the
 * Python fake with execv and the same argv, so the daemon side (-d, -f),
 * fault injection, -v, -h and every error path stay the Python fake's.
 *
 * Built by tests/fakes/mps_client.py (gcc, cached under build/ by source
 * hash) with -DPY_FAKE="<absolute path of the Python fake>".
 *
 * Parity with the Python fake's client() and main() (argv, stdin, output,
 * exit status), as tests/component/test_fake_mps_client.py checks:
 *   - argv is parsed as main() does: -m, -q, -p N / --protocol=N, -a F /
 *     --apply=F are options until the first other word; that word and every
 *     word after it are the command ("argv" request). -d/-f/-v/-h (long forms
 *     too), an option without its value, a protocol that is not plain ASCII
 *     digits (also CUDA_MPS_PROTOCOL_VERSION), and an argv that is not UTF-8:
 *     execv of the Python fake, which then does what it always did.
 *   - -q: one v2 "quit"; a command in argv: one "argv" request; neither: one
 *     v2 request per non-blank stdin line (lines end at "\n" only, as
 *     Python's sys.stdin on POSIX, whose newline is "\n": a "\r" is
 *     whitespace; words split on Python's str.split() whitespace, Unicode
 *     included).
 *   - wire (one request per connection to $CUDA_MPS_PIPE_DIRECTORY/control,
 *     default /tmp/nvidia-mps): request "<kind>\x1f<word>\x1e<word>...\n",
 *     reply "<rc>\n<output>" until EOF.
 *   - messages: "Cannot find MPS control daemon process" (no connect) and
 *     "Connection to the MPS control daemon broke" (send/recv failed, or the
 *     reply has no "<rc>\n" head) on stderr, rc 1; the output, if any, plus
 *     "\n" on stdout (argv and -q: on stderr when rc != 0; stdin lines:
 *     always stdout); exit status: the command's rc (stdin: the first
 *     non-zero one).
 * Known differences, outside what the fake daemon can produce or what the
 * product sends: stdin bytes that are not UTF-8 end the run with a one-line
 * error and exit 1 (Python: a traceback and exit 1, or with a strict stdin
 * decoder it may fail earlier in the same read chunk); reply bytes are written
 * as received (Python replaces invalid UTF-8 with U+FFFD; the fake daemon
 * only sends UTF-8); a reply head such as "--1" is "broke" here (Python: a
 * traceback).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef PY_FAKE
#error "build with -DPY_FAKE=\"/absolute/path/of/tests/fakes/nvidia-cuda-mps-control\""
#endif

static char **g_argv;

/* Hand this invocation to the Python fake (same argv, same environment). */
static void exec_python(void) {
    execv(PY_FAKE, g_argv);
    dprintf(2, "nvidia-cuda-mps-control (fake C client): cannot exec %s: %s\n", PY_FAKE, strerror(errno));
    _exit(127);
}

static void put(int fd, const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return; /* nowhere to report it */
        }
        s += w;
        n -= (size_t)w;
    }
}

static void puts_fd(int fd, const char *s) { put(fd, s, strlen(s)); }

static int ascii_digits(const char *s) {
    if (!*s)
        return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9')
            return 0;
    return 1;
}

/* Decode one UTF-8 code point at s[0..n) into *cp; returns its length, or 0
 * when it is not valid UTF-8 (as Python's strict decoder: no overlongs, no
 * surrogates, nothing above U+10FFFF). */
static size_t utf8_next(const unsigned char *s, size_t n, unsigned *cp) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        len = 2, min = 0x80, c &= 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, min = 0x800, c &= 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, min = 0x10000, c &= 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        c = (c << 6) | (s[i] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF))
        return 0;
    *cp = c;
    return len;
}

static int utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s);
    unsigned cp;
    while (n > 0) {
        size_t k = utf8_next(p, n, &cp);
        if (!k)
            return 0;
        p += k;
        n -= k;
    }
    return 1;
}

/* Python's str.isspace(), the separators of str.split() and str.strip(). */
static int py_space(unsigned cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
           cp == 0x205F || cp == 0x3000;
}

/* A growable byte buffer; out of memory ends the process (exit 1). */
struct buf {
    char *p;
    size_t n, cap;
};

static void buf_add(struct buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            puts_fd(2, "nvidia-cuda-mps-control (fake C client): out of memory\n");
            exit(1);
        }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static const char *pipe_dir(void) {
    const char *d = getenv("CUDA_MPS_PIPE_DIRECTORY");
    return (d && *d) ? d : "/tmp/nvidia-mps";
}

/* One request (the wire bytes, "\n" included) -> (rc, output). Mirrors the
 * Python fake's client(): prints its own failures to stderr. */
static long long request(const struct buf *wire, struct buf *out) {
    struct sockaddr_un sa;
    struct buf path = {0};
    const char *dir = pipe_dir();
    size_t dl = strlen(dir);
    buf_add(&path, dir, dl);
    if (dl == 0 || dir[dl - 1] != '/') /* os.path.join */
        buf_add(&path, "/", 1);
    buf_add(&path, "control", 7);
    out->n = 0;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
        dprintf(2, "nvidia-cuda-mps-control (fake C client): socket: %s\n", strerror(errno));
        exit(1);
    }
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    /* CPython: a path longer than sun_path is an OSError, caught as "cannot find" */
    int ok = path.n <= sizeof sa.sun_path;
    if (ok) {
        memcpy(sa.sun_path, path.p, path.n);
        socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + path.n);
        int r;
        do
            r = connect(s, (struct sockaddr *)&sa, len);
        while (r < 0 && errno == EINTR);
        ok = r == 0;
    }
    free(path.p);
    if (!ok) {
        puts_fd(2, "Cannot find MPS control daemon process\n");
        close(s);
        return 1;
    }
    struct buf reply = {0};
    const char *p = wire->p;
    size_t left = wire->n;
    while (left > 0 && ok) {
        ssize_t w = send(s, p, left, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno != EINTR)
                ok = 0;
            continue;
        }
        p += w;
        left -= (size_t)w;
    }
    while (ok) {
        char chunk[65536];
        ssize_t r = recv(s, chunk, sizeof chunk, 0);
        if (r < 0) {
            if (errno != EINTR)
                ok = 0;
            continue;
        }
        if (r == 0)
            break;
        buf_add(&reply, chunk, (size_t)r);
    }
    close(s);
    /* head: "-?[0-9]+" then "\n" */
    char *nl = (ok && reply.n) ? memchr(reply.p, '\n', reply.n) : NULL;
    if (nl) {
        char *q = reply.p;
        if (*q == '-')
            q++;
        if (q == nl)
            nl = NULL;
        for (; nl && q < nl; q++)
            if (*q < '0' || *q > '9')
                nl = NULL;
    }
    if (!nl) {
        puts_fd(2, "Connection to the MPS control daemon broke\n");
        free(reply.p);
        return 1;
    }
    *nl = 0;
    long long rc = strtoll(reply.p, NULL, 10);
    size_t head = (size_t)(nl - reply.p) + 1;
    buf_add(out, reply.p + head, reply.n - head);
    free(reply.p);
    return rc;
}

static const char FS = '\x1f', RS = '\x1e';

/* print(out, file=fd) when out is non-empty */
static void print_out(int fd, const struct buf *out) {
    if (out->n) {
        put(fd, out->p, out->n);
        put(fd, "\n", 1);
    }
}

/* One stdin line (without its terminator): a v2 request of its words, unless
 * it is blank. Returns 0 for a blank line, else sets *rc and returns 1. */
static int v2_line(const char *line, size_t n, long long *rc) {
    const unsigned char *p = (const unsigned char *)line;
    struct buf wire = {0}, out = {0};
    int words = 0;
    size_t i = 0;
    buf_add(&wire, "v2", 2);
    buf_add(&wire, &FS, 1);
    while (i < n) {
        unsigned cp;
        size_t k = utf8_next(p + i, n - i, &cp);
        if (!k) {
            puts_fd(2, "nvidia-cuda-mps-control (fake C client): stdin is not valid UTF-8\n");
            exit(1);
        }
        if (py_space(cp)) {
            i += k;
            continue;
        }
        size_t start = i;
        while (i < n) { /* the word runs to the next whitespace */
            k = utf8_next(p + i, n - i, &cp);
            if (!k) {
                puts_fd(2, "nvidia-cuda-mps-control (fake C client): stdin is not valid UTF-8\n");
                exit(1);
            }
            if (py_space(cp))
                break;
            i += k;
        }
        if (words++)
            buf_add(&wire, &RS, 1);
        buf_add(&wire, line + start, i - start);
    }
    if (!words) {
        free(wire.p);
        return 0;
    }
    buf_add(&wire, "\n", 1);
    *rc = request(&wire, &out);
    print_out(1, &out);
    free(wire.p);
    free(out.p);
    return 1;
}

static int stdin_mode(void) {
    struct buf line = {0};
    long long rc_all = 0, rc;
    char chunk[4096];
    if (fcntl(0, F_GETFD) < 0)
        exec_python(); /* no stdin at all: Python's own failure */
    for (;;) {
        ssize_t r = read(0, chunk, sizeof chunk);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (r == 0)
            break;
        for (ssize_t i = 0; i < r; i++) {
            char c = chunk[i];
            if (c == '\n') { /* Python's sys.stdin on POSIX: newline="\n" ("\r" is whitespace) */
                if (v2_line(line.p ? line.p : "", line.n, &rc) && !rc_all)
                    rc_all = rc;
                line.n = 0;
            } else {
                buf_add(&line, &c, 1);
            }
        }
    }
    if (line.n && v2_line(line.p, line.n, &rc) && !rc_all)
        rc_all = rc;
    free(line.p);
    return (int)rc_all;
}

int main(int argc, char **argv) {
    g_argv = argv;
    int quit = 0, rest = 0;
    for (int i = 1; i < argc; i++) {
        if (!utf8_valid(argv[i]))
            exec_python();
    }
    for (int i = 1; i < argc && !rest; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-d") || !strcmp(a, "--daemon") || !strcmp(a, "-f") || !strcmp(a, "--foreground") ||
            !strcmp(a, "-v") || !strcmp(a, "--version") || !strcmp(a, "-h") || !strcmp(a, "--help")) {
            exec_python();
        } else if (!strcmp(a, "-m") || !strcmp(a, "--multiuser")) {
            /* no effect on a client */
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quit")) {
            quit = 1;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--protocol") || !strcmp(a, "-a") || !strcmp(a, "--apply")) {
            int protocol = !strcmp(a, "-p") || !strcmp(a, "--protocol");
            if (i + 1 >= argc || (protocol && !ascii_digits(argv[i + 1])))
                exec_python(); /* Python: "option needs a value" or int()'s ValueError */
            i++;
        } else if (!strncmp(a, "--protocol=", 11)) {
            if (!ascii_digits(a + 11))
                exec_python();
        } else if (!strncmp(a, "--apply=", 8)) {
            /* no effect on a client */
        } else {
            rest = i;
        }
    }
    const char *env_proto = getenv("CUDA_MPS_PROTOCOL_VERSION");
    if (env_proto && *env_proto && !ascii_digits(env_proto))
        exec_python();
    /* a client from here on: a closed reader is an error of the call, not a signal */
    signal(SIGPIPE, SIG_IGN);
    if (quit || rest) {
        struct buf wire = {0}, out = {0};
        if (quit) {
            buf_add(&wire, "v2\x1fquit", 7);
        } else {
            buf_add(&wire, "argv", 4);
            buf_add(&wire, &FS, 1);
            for (int i = rest; i < argc; i++) {
                if (i > rest)
                    buf_add(&wire, &RS, 1);
                buf_add(&wire, argv[i], strlen(argv[i]));
            }
        }
        buf_add(&wire, "\n", 1);
        long long rc = request(&wire, &out);
        print_out(rc ? 2 : 1, &out);
        return (int)rc;
    }
    return stdin_mode();
}
