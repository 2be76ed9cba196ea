/* The tokenizer thread of an inference server (see server_int.h, struct tok_job): the body of each
 * completion is read here (server_req.c: parsed, checked, its text prompt encoded), one request at
 * a time in arrival order, so that the event loop goes on answering /health, /metrics and every
 * stream meanwhile. On the loop a prompt at the byte limit (65,536 tokens x 120 bytes of spaces,
 * 7.5 MiB) held them all for 4.6 s, past the proxy's 1 s health timeout, and the proxy took the
 * instance out; a body of 4 M token ids (8 MiB) held them for 0.4-0.6 s. The tokenizer is never
 * modified once loaded, so this thread and the loop (decoding answers) share it without a lock. */
#include "pd/server_int.h"
#include "core/threadpool.h"

static void *tok_loop(void *arg)
{
    struct pd_server *s = arg;
    pthread_mutex_lock(&s->tok_mu);
    for (;;) {
        while (!s->tok_todo && !s->tok_stop)
            pthread_cond_wait(&s->tok_cv, &s->tok_mu);
        if (s->tok_stop)
            break;   /* the jobs left are answered by pd_srv_tok_stop */
        struct tok_job *jb = s->tok_todo;
        s->tok_todo = jb->next;
        if (!s->tok_todo)
            s->tok_todo_tail = NULL;
        pthread_mutex_unlock(&s->tok_mu);
        pd_srv_req_prepare(s, jb);
        pthread_mutex_lock(&s->tok_mu);
        jb->next = s->tok_done;
        s->tok_done = jb;
        event_active(s->tok_ready, 0, 0);
    }
    pthread_mutex_unlock(&s->tok_mu);
    return NULL;
}

static void job_free(struct tok_job *jb)
{
    if (jb->body)
        evbuffer_free(jb->body);
    pd_srv_req_discard(jb->r);
    free(jb);
}

/* Its client left while the request was being read: the job is dropped once it is back. A
 * request detached from its connection is libevent's to free only once answered (as
 * pd_srv_on_close does). */
static void on_job_close(struct evhttp_connection *c, void *arg)
{
    struct tok_job *jb = arg;
    struct evhttp_request *h = jb->h;
    jb->h = NULL;
    if (h && !jb->s->destroying && !evhttp_request_get_connection(h))
        evhttp_send_reply(h, 499, "Client Closed Request", NULL);
}

/* s->tok_ready: the jobs the thread has finished, in the order they came. */
static void on_tok_ready(evutil_socket_t fd, short what, void *arg)
{
    struct pd_server *s = arg;
    pthread_mutex_lock(&s->tok_mu);
    struct tok_job *list = s->tok_done, *fifo = NULL;
    s->tok_done = NULL;
    pthread_mutex_unlock(&s->tok_mu);
    while (list) {
        struct tok_job *jb = list;
        list = jb->next;
        jb->next = fifo;
        fifo = jb;
    }
    while (fifo) {
        struct tok_job *jb = fifo;
        fifo = jb->next;
        assert(s->n_tokenizing > 0);
        s->n_tokenizing--;
        if (jb->h) {
            pd_http_set_closecb(jb->h, NULL, NULL);
            pd_srv_admit(s, jb);
        }
        job_free(jb);
    }
}

int pd_srv_tok_start(struct pd_server *s, pd_err *e)
{
    if (!(s->tok_ready = event_new(s->base, -1, 0, on_tok_ready, s)))
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    int rc = pd_thread_start(&s->tok_thread, tok_loop, s, "tokenizer thread", e);
    if (rc)
        return rc;
    s->tok_thread_started = 1;
    return 0;
}

void pd_srv_tok_submit(struct pd_server *s, struct tok_job *jb)
{
    s->n_tokenizing++;
    pd_http_set_closecb(jb->h, on_job_close, jb);
    jb->next = NULL;
    pthread_mutex_lock(&s->tok_mu);
    if (s->tok_todo_tail)
        s->tok_todo_tail->next = jb;
    else
        s->tok_todo = jb;
    s->tok_todo_tail = jb;
    pthread_cond_signal(&s->tok_cv);
    pthread_mutex_unlock(&s->tok_mu);
}

int pd_srv_tok_stop(struct pd_server *s)
{
    if (s->tok_thread_started) {
        pthread_mutex_lock(&s->tok_mu);
        s->tok_stop = 1;
        pthread_cond_signal(&s->tok_cv);
        pthread_mutex_unlock(&s->tok_mu);
        pthread_join(s->tok_thread, NULL);
        s->tok_thread_started = 0;
    }
    int answered = 0;
    struct tok_job *lists[2] = {s->tok_todo, s->tok_done};
    s->tok_todo = s->tok_todo_tail = s->tok_done = NULL;
    for (int k = 0; k < 2; k++)
        for (struct tok_job *jb = lists[k], *nx; jb; jb = nx) {
            nx = jb->next;
            if (jb->h) {
                pd_http_set_closecb(jb->h, NULL, NULL);
                pd_srv_send_error(s, jb->h, 503, "server_error", NULL, "the server is shutting down");
                answered++;
            }
            s->n_tokenizing--;
            job_free(jb);
        }
    if (s->tok_ready) {
        event_free(s->tok_ready);
        s->tok_ready = NULL;
    }
    return answered;
}
