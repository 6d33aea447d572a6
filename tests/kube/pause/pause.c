/* The pod sandbox's process, as Kubernetes' build/pause/linux/pause.c: it holds the pod's
 * namespaces open, reaps the zombies re-parented to it (it is PID 1 of the pod's PID namespace
 * when the pod shares one), and exits at once on SIGINT or SIGTERM. Built statically by
 * tests/kube/node_images.py into the image containerd runs as each pod's sandbox. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_terminate(int signo) {
    (void)signo;
    _exit(0);
}

static void on_child(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

static int handle(int signo, void (*handler)(int), int flags) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = handler;
    action.sa_flags = flags;
    sigemptyset(&action.sa_mask);
    return sigaction(signo, &action, NULL);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("pause (kvpilot tests)");
        return 0;
    }
    if (getpid() != 1) {
        fputs("pause: warning: not PID 1, orphans are not reaped here\n", stderr);
    }
    if (handle(SIGINT, on_terminate, 0) || handle(SIGTERM, on_terminate, 0) ||
        handle(SIGCHLD, on_child, SA_NOCLDSTOP)) {
        perror("pause: sigaction");
        return 1;
    }
    for (;;) {
        pause();
    }
}
