/* The processor's optional native reader of queue records (serialized trainguard.v1.IngestRequest).
 *
 * read(value) -> list, one item per envelope of the request, in order: for a *plain* metric batch (payload
 * ``metrics`` set once and no other payload field after it, no ``alert``, no ``recent`` point, a non-empty
 * ``run_id``) the tuple ``(header, count, points)``:
 *   header -- (event_id, project, run_id, rank, step, time_unix_nano, host, pid, world_size, run_name,
 *              trace_id): ReadEnvelope's header fields in its order, as protobuf reads them (proto3 defaults
 *              when absent, the last occurrence when a field is repeated; world_size at least 1);
 *   count  -- the batch's point messages (those without a name included);
 *   points -- ``(name, step, value)`` of its points with a non-empty name, ``step`` the point's when > 0,
 *             else the envelope's (what decode._read_points builds);
 * for a memory envelope (payload ``memory`` set once and no other payload field ever) its dict, as
 * wire.envelope_to_dict builds it (memory_envelope below; anything unusual in its payload's bytes: None);
 * None for any other envelope (the caller reads it with protobuf). Returns None for the whole request when
 * its bytes hold anything this reader does not take apart exactly as protobuf does (a known field with
 * another wire type, a field number 0, groups, a string that is not UTF-8 -- every string field of a plain
 * envelope is checked, ``sdk`` included --, a varint longer than 64 bits, a truncated field): the caller then
 * reads the request with protobuf, whose errors are the errors. Unknown fields are skipped, as protobuf
 * skips them. A plain envelope's reader never needs protobuf's parse.
 *
 * ``value`` must be ``bytes`` (immutable while it is read); anything else gives None (protobuf reads it).
 *
 * Memory safety (records are untrusted bytes -- a Kafka topic anyone with access can write): every read is
 * bounded by the buffer's end before it happens (varints, lengths, fixed64); lengths are compared with what
 * is left before use; no recursion (three fixed levels); each loop advances at least one byte; strings point
 * into the buffer only during the call (the per-call cache holds their Python objects; short ASCII strings --
 * names, project, run id, host, and the checked-only ones such as ``sdk`` -- are also kept across calls in a
 * module-wide table of at most KEPT_SLOTS objects: kept_str below; returned event ids never are). read_envelopes
 * builds only objects whose types and slot offsets setup() verified (member descriptors of those very
 * types); add_points holds what it uses and re-reads its list at each point (allocating may run finalizers).
 *
 * Field numbers: proto/trainguard/v1/events.proto (decode.py checks them against the generated descriptors
 * before it uses this module). Our own code; no dependency beyond the Python C API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Cursor;

/* 0 on success, -1 when truncated or longer than 10 bytes */
static int read_varint(Cursor *c, uint64_t *out) {
    uint64_t v = 0;
    int shift = 0;
    while (c->p < c->end && shift < 70) {
        unsigned char b = *c->p++;
        if (shift == 63 && (b & 0x7e)) return -1; /* more than 64 bits: protobuf's to judge */
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
        shift += 7;
    }
    return -1;
}

/* A field's tag: -1 unless a varint of at most 5 bytes, at most 32 bits, with a field number (protobuf's
 * own limits: anything else is its to judge). */
static int read_tag(Cursor *c, uint64_t *out) {
    const unsigned char *start = c->p;
    if (read_varint(c, out) < 0 || c->p - start > 5 || *out > 0xFFFFFFFFu || (*out >> 3) == 0) return -1;
    return 0;
}

/* A length prefix: -1 unless a varint of at most 5 bytes, at most INT32_MAX and within the bytes left
 * (upb's _upb_Decoder_DecodeSize refuses a longer or larger one as a corrupt wire format). */
static int read_size(Cursor *c, uint64_t *out) {
    const unsigned char *start = c->p;
    if (read_varint(c, out) < 0 || c->p - start > 5 || *out > 0x7FFFFFFFu || *out > (uint64_t)(c->end - c->p))
        return -1;
    return 0;
}

/* Skip a field's value of wire type wt; -1 on a group or truncation. */
static int skip_value(Cursor *c, unsigned wt) {
    uint64_t n;
    switch (wt) {
    case 0:
        return read_varint(c, &n);
    case 1:
        if (c->end - c->p < 8) return -1;
        c->p += 8;
        return 0;
    case 2:
        if (read_size(c, &n) < 0) return -1;
        c->p += n;
        return 0;
    case 5:
        if (c->end - c->p < 4) return -1;
        c->p += 4;
        return 0;
    default:
        return -1;
    }
}

/* A length-delimited value: its bytes in [*start, *start + *len). */
static int read_len(Cursor *c, const unsigned char **start, Py_ssize_t *len) {
    uint64_t n;
    if (read_size(c, &n) < 0) return -1;
    *start = c->p;
    *len = (Py_ssize_t)n;
    c->p += n;
    return 0;
}

typedef struct {
    const unsigned char *s;
    Py_ssize_t n;
} Slice;

/* Strings seen in this request (names and repeated header values): one str object per distinct text. */
#define CACHE_MAX 64
typedef struct {
    Slice key[CACHE_MAX];
    PyObject *value[CACHE_MAX];
    int count;
    PyObject *empty;
} StrCache;

/* ASCII strings of earlier requests (names, project, run id, host...: the same few over and over), kept
 * across calls in a direct-mapped table by a hash of their bytes: a string found there is that object
 * again (an ASCII str is its bytes: equal to what decoding them gives), not decoded and allocated anew --
 * and the pipeline's dict lookups by it meet the same object, its hash already known. A slot holds the last
 * string that hashed to it (at most KEPT_SLOTS strings of at most KEPT_MAX bytes are kept alive). */
#define KEPT_SLOTS 1024
#define KEPT_MAX 128
static PyObject *kept[KEPT_SLOTS];

static size_t kept_slot(Slice s) {
    uint32_t h = 2166136261u; /* FNV-1a */
    Py_ssize_t i;
    for (i = 0; i < s.n; i++) h = (h ^ s.s[i]) * 16777619u;
    return (size_t)(h & (KEPT_SLOTS - 1));
}

/* A new reference to the kept string of s's bytes, or NULL (none: no error set). */
static PyObject *kept_str(Slice s, size_t slot) {
    PyObject *obj = kept[slot];
    if (obj == NULL || !PyUnicode_IS_COMPACT_ASCII(obj) || PyUnicode_GET_LENGTH(obj) != s.n ||
        memcmp(PyUnicode_DATA(obj), s.s, (size_t)s.n) != 0)
        return NULL;
    Py_INCREF(obj);
    return obj;
}

/* Keep obj (the string of s's bytes) in its slot when it is ASCII and short. */
static void keep_str(PyObject *obj, size_t slot) {
    PyObject *old;
    if (!PyUnicode_IS_COMPACT_ASCII(obj) || PyUnicode_GET_LENGTH(obj) > KEPT_MAX) return;
    old = kept[slot];
    Py_INCREF(obj);
    kept[slot] = obj;
    Py_XDECREF(old); /* a str: no Python code runs */
}

static PyObject *cached_str(StrCache *cache, Slice s) {
    int i;
    size_t slot;
    PyObject *obj;
    if (s.n == 0) {
        Py_INCREF(cache->empty);
        return cache->empty;
    }
    for (i = 0; i < cache->count; i++) {
        if (cache->key[i].n == s.n && memcmp(cache->key[i].s, s.s, (size_t)s.n) == 0) {
            Py_INCREF(cache->value[i]);
            return cache->value[i];
        }
    }
    slot = s.n <= KEPT_MAX ? kept_slot(s) : 0;
    obj = s.n <= KEPT_MAX ? kept_str(s, slot) : NULL;
    if (obj == NULL) {
        obj = PyUnicode_DecodeUTF8((const char *)s.s, s.n, "strict");
        if (obj == NULL) return NULL;
        if (s.n <= KEPT_MAX) keep_str(obj, slot);
    }
    if (cache->count < CACHE_MAX) {
        cache->key[cache->count] = s;
        Py_INCREF(obj);
        cache->value[cache->count++] = obj;
    }
    return obj;
}

static void cache_clear(StrCache *cache) {
    int i;
    for (i = 0; i < cache->count; i++) Py_DECREF(cache->value[i]);
    cache->count = 0;
}

#define BAIL_RECORD -2 /* the whole request goes to protobuf */
#define NOT_PLAIN -1   /* this envelope goes to protobuf */

/* A string occurrence that is not returned (overwritten by a later one, sdk, alert) checked as protobuf
 * checks it: 0 when UTF-8, BAIL_RECORD when not, -3 on a Python error. */
static int check_utf8(StrCache *cache, Slice s) {
    PyObject *o;
    if (s.s == NULL || s.n == 0) return 0;
    o = cached_str(cache, s);
    if (o != NULL) {
        Py_DECREF(o);
        return 0;
    }
    if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        return BAIL_RECORD;
    }
    return -3;
}

/* One Metric message: appends (name, step, value) to points when its name is not empty. */
/* ``env_step``: the envelope's step as an int object, shared by every point without a step of its own (an int
 * is immutable: the same value as one object per point, fewer allocations). */
static int read_point(const unsigned char *s, Py_ssize_t n, PyObject *env_step, StrCache *cache,
                      PyObject *points) {
    Cursor c = {s, s + n};
    Slice name = {NULL, 0};
    int64_t step = 0;
    uint64_t bits = 0, tag, v;
    double value;
    PyObject *tuple, *o;
    int rc;
    while (c.p < c.end) {
        if (read_tag(&c, &tag) < 0) return BAIL_RECORD;
        switch (tag) {
        case (1 << 3) | 2:
            if ((rc = check_utf8(cache, name)) < 0) return rc; /* an earlier occurrence */
            if (read_len(&c, &name.s, &name.n) < 0) return BAIL_RECORD;
            break;
        case (2 << 3) | 1:
            if (c.end - c.p < 8) return BAIL_RECORD;
            memcpy(&bits, c.p, 8); /* little-endian wire = x86/ARM little-endian host (checked at import) */
            c.p += 8;
            break;
        case (3 << 3) | 0:
            if (read_varint(&c, &v) < 0) return BAIL_RECORD;
            step = (int64_t)v;
            break;
        default:
            if ((tag >> 3) >= 1 && (tag >> 3) <= 3) return BAIL_RECORD; /* a known field, another wire type */
            if (tag >> 3 == 0 || skip_value(&c, (unsigned)(tag & 7)) < 0) return BAIL_RECORD;
        }
    }
    if (name.n == 0) return 0;
    memcpy(&value, &bits, 8);
    tuple = PyTuple_New(3);
    if (tuple == NULL) return -3;
    o = cached_str(cache, name);
    if (o == NULL) {
        Py_DECREF(tuple);
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            return BAIL_RECORD;
        }
        return -3;
    }
    PyTuple_SET_ITEM(tuple, 0, o);
    if (step > 0) {
        o = PyLong_FromLongLong(step);
    } else {
        Py_INCREF(env_step);
        o = env_step;
    }
    if (o == NULL) {
        Py_DECREF(tuple);
        return -3;
    }
    PyTuple_SET_ITEM(tuple, 1, o);
    o = PyFloat_FromDouble(value);
    if (o == NULL) {
        Py_DECREF(tuple);
        return -3;
    }
    PyTuple_SET_ITEM(tuple, 2, o);
    if (PyList_Append(points, tuple) < 0) {
        Py_DECREF(tuple);
        return -3;
    }
    Py_DECREF(tuple);
    return 0;
}

#define MEMORY 1 /* read_envelope: a memory envelope, its dict built */

/* --- memory envelopes ------------------------------------------------------------------------------------
 * An envelope whose payload is ``memory`` (a MemorySnapshot), given once and no other payload member ever,
 * becomes its dict -- wire.envelope_to_dict's, key for key, in its order, type for type: the header fields
 * that are not their default, by field number (``severity`` by its name, a number without one as the int),
 * then ``memory``: its fields that are not their default, by field number, a double as a float or
 * "NaN"/"Infinity"/"-Infinity" (wire's emit), ``stats`` when it has entries: its keys sorted (wire's
 * emit_map), each key's last value. Anything else in the payload's bytes -- a field given twice, an unknown
 * field, another wire type, a string that is not UTF-8, a map entry with more than a key and a value --
 * leaves the envelope to protobuf (NOT_PLAIN). The header's checks are read_envelope's. */
#define HEAD_FIELDS 15
#define MEM_FIELDS 13
static const char *const head_names[HEAD_FIELDS] = {
    "event_id", "project", "run_id", "trace_id", "host", "pid", "rank", "local_rank", "world_size", "step",
    "time_unix_nano", "severity", "run_name", "sdk", "group_rank"};
static const char *const mem_names[MEM_FIELDS] = {
    "device", "allocated", "reserved", "active", "max_allocated", "total_capacity", "free", "fragmentation",
    "num_alloc_retries", "num_ooms", "rss", "summary", "stats"};
#define SEVERITIES 6
static const char *const severity_names[SEVERITIES] = {"SEVERITY_UNSPECIFIED", "DEBUG", "INFO", "WARNING",
                                                       "ERROR", "CRITICAL"};
static PyObject *head_keys[HEAD_FIELDS], *mem_keys[MEM_FIELDS], *severity_strs[SEVERITIES];
static PyObject *key_memory, *str_nan, *str_inf, *str_ninf;

static int make_keys(void) {
    int i;
    for (i = 0; i < HEAD_FIELDS; i++)
        if ((head_keys[i] = PyUnicode_InternFromString(head_names[i])) == NULL) return -1;
    for (i = 0; i < MEM_FIELDS; i++)
        if ((mem_keys[i] = PyUnicode_InternFromString(mem_names[i])) == NULL) return -1;
    for (i = 0; i < SEVERITIES; i++)
        if ((severity_strs[i] = PyUnicode_InternFromString(severity_names[i])) == NULL) return -1;
    key_memory = PyUnicode_InternFromString("memory");
    str_nan = PyUnicode_InternFromString("NaN");
    str_inf = PyUnicode_InternFromString("Infinity");
    str_ninf = PyUnicode_InternFromString("-Infinity");
    return key_memory == NULL || str_nan == NULL || str_inf == NULL || str_ninf == NULL ? -1 : 0;
}

/* A double as wire's _emit_double writes it (a new reference). */
static PyObject *emit_double(double d) {
    PyObject *o;
    if (d - d == 0.0) return PyFloat_FromDouble(d);
    o = d != d ? str_nan : (d > 0 ? str_inf : str_ninf);
    Py_INCREF(o);
    return o;
}

/* A str of s, the request's cached one (cached: 1) or a new one: NULL with NOT_PLAIN in *rc when not
 * UTF-8, NULL with -3 on another error. */
static PyObject *text_str(StrCache *cache, Slice s, int cached, int *rc) {
    PyObject *o = cached ? cached_str(cache, s) : PyUnicode_DecodeUTF8((const char *)s.s, s.n, "strict");
    if (o == NULL) {
        *rc = -3;
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            *rc = NOT_PLAIN;
        }
    }
    return o;
}

/* One ``stats`` map entry (the cursor at its length) into *stats (created at the first): 0, NOT_PLAIN, or
 * -3 with a Python error. A missing key is "", a missing value 0.0 (protobuf's defaults). */
static int map_entry(Cursor *c, StrCache *cache, PyObject **stats) {
    const unsigned char *es;
    Py_ssize_t en;
    Cursor e;
    uint64_t tag;
    Slice key = {NULL, 0};
    double value = 0.0;
    int got_key = 0, got_value = 0, rc = 0;
    PyObject *k, *v;
    if (read_len(c, &es, &en) < 0) return NOT_PLAIN;
    e.p = es;
    e.end = es + en;
    while (e.p < e.end) {
        if (read_tag(&e, &tag) < 0) return NOT_PLAIN;
        if (tag == ((1 << 3) | 2) && !got_key) {
            if (read_len(&e, &key.s, &key.n) < 0) return NOT_PLAIN;
            got_key = 1;
        } else if (tag == ((2 << 3) | 1) && !got_value) {
            if (e.end - e.p < 8) return NOT_PLAIN;
            memcpy(&value, e.p, 8); /* little-endian: decode.schema_matches */
            e.p += 8;
            got_value = 1;
        } else {
            return NOT_PLAIN;
        }
    }
    if (*stats == NULL && (*stats = PyDict_New()) == NULL) return -3;
    k = text_str(cache, key, 1, &rc);
    if (k == NULL) return rc;
    v = PyFloat_FromDouble(value);
    if (v == NULL || PyDict_SetItem(*stats, k, v) < 0) rc = -3; /* str keys: no Python code runs */
    Py_DECREF(k);
    Py_XDECREF(v);
    return rc;
}

/* ``stats`` as wire emits it: its keys sorted, each value emit_double'd (a new dict), or NULL (-3). */
static PyObject *sorted_stats(PyObject *stats) {
    PyObject *keys = PyDict_Keys(stats), *out = NULL;
    Py_ssize_t i;
    if (keys == NULL || PyList_Sort(keys) < 0 || (out = PyDict_New()) == NULL) goto fail;
    for (i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *k = PyList_GET_ITEM(keys, i), *v = PyDict_GetItemWithError(stats, k), *o;
        if (v == NULL || !PyFloat_CheckExact(v)) goto fail;
        o = emit_double(PyFloat_AS_DOUBLE(v));
        if (o == NULL || PyDict_SetItem(out, k, o) < 0) {
            Py_XDECREF(o);
            goto fail;
        }
        Py_DECREF(o);
    }
    Py_DECREF(keys);
    return out;
fail:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the stats map changed while sorted");
    Py_XDECREF(keys);
    Py_XDECREF(out);
    return NULL;
}

/* Set d[key] = o (o's reference taken; NULL: rc says why). 0, or NOT_PLAIN / -3. */
static int put(PyObject *d, PyObject *key, PyObject *o, int rc) {
    if (o == NULL) return rc == NOT_PLAIN ? NOT_PLAIN : -3;
    rc = PyDict_SetItem(d, key, o) < 0 ? -3 : 0;
    Py_DECREF(o);
    return rc;
}

/* The dict of a memory envelope into *out (MEMORY), or NOT_PLAIN / -3. ``text`` and ``num``: the header's
 * string and number fields by field number (read_envelope's); s, n: the MemorySnapshot's bytes. */
static int memory_envelope(const Slice *text, const int64_t *num, const unsigned char *s, Py_ssize_t n,
                           StrCache *cache, PyObject **out) {
    Cursor c = {s, s + n};
    Slice mtext[MEM_FIELDS + 1];
    uint64_t mnum[MEM_FIELDS + 1], tag;
    double fragmentation = 0.0;
    unsigned seen = 0, field, wt;
    PyObject *stats = NULL, *mem = NULL, *env = NULL, *o;
    int rc = NOT_PLAIN, i;
    memset(mtext, 0, sizeof(mtext));
    memset(mnum, 0, sizeof(mnum));
    while (c.p < c.end) {
        if (read_tag(&c, &tag) < 0) goto done;
        field = (unsigned)(tag >> 3);
        wt = (unsigned)(tag & 7);
        if (field < 1 || field > MEM_FIELDS) goto done; /* unknown: protobuf's */
        if (field != 13) {                                /* a scalar given twice: protobuf's */
            if (seen & (1u << field)) goto done;
            seen |= 1u << field;
        }
        if (field == 1 || field == 12) {
            if (wt != 2 || read_len(&c, &mtext[field].s, &mtext[field].n) < 0) goto done;
        } else if (field == 8) {
            if (wt != 1 || c.end - c.p < 8) goto done;
            memcpy(&fragmentation, c.p, 8);
            c.p += 8;
        } else if (field == 13) {
            if (wt != 2) goto done;
            rc = map_entry(&c, cache, &stats);
            if (rc < 0) goto done;
            rc = NOT_PLAIN;
        } else if (wt != 0 || read_varint(&c, &mnum[field]) < 0) {
            goto done;
        }
    }
    rc = -3;
    if ((mem = PyDict_New()) == NULL || (env = PyDict_New()) == NULL) goto done;
    rc = 0;
    for (i = 1; i <= MEM_FIELDS && rc == 0; i++) {
        if (i == 1 || i == 12) {
            if (mtext[i].n == 0) continue;
            o = text_str(cache, mtext[i], i == 1, &rc);
        } else if (i == 8) {
            if (fragmentation == 0.0) continue; /* 0.0 and -0.0 are falsy, NaN is not: wire's test */
            o = emit_double(fragmentation);
        } else if (i == 13) {
            if (stats == NULL || PyDict_GET_SIZE(stats) == 0) continue;
            o = sorted_stats(stats);
        } else {
            if (mnum[i] == 0) continue;
            o = PyLong_FromLongLong((int64_t)mnum[i]);
        }
        rc = put(mem, mem_keys[i - 1], o, rc);
    }
    for (i = 1; i <= HEAD_FIELDS && rc == 0; i++) {
        if (i <= 5 || i == 13 || i == 14) {
            if (text[i].n == 0) continue;
            o = text_str(cache, text[i], i != 1, &rc); /* event ids are never kept (read_envelope) */
        } else {
            if (num[i] == 0) continue;
            if (i == 12 && num[i] > 0 && num[i] < SEVERITIES) {
                o = severity_strs[num[i]];
                Py_INCREF(o);
            } else {
                o = PyLong_FromLongLong(num[i]);
            }
        }
        rc = put(env, head_keys[i - 1], o, rc);
    }
    if (rc == 0) rc = PyDict_SetItem(env, key_memory, mem) < 0 ? -3 : MEMORY;
done:
    Py_XDECREF(stats);
    Py_XDECREF(mem);
    if (rc == MEMORY) {
        *out = env;
    } else {
        Py_XDECREF(env);
    }
    return rc;
}

/* Header string fields, in the tuple's order */
enum { F_EVENT_ID, F_PROJECT, F_RUN_ID, F_HOST, F_RUN_NAME, F_TRACE_ID, F_STRINGS };

/* What read_envelope reads of a plain batch (new references): the header fields in the order of read()'s
 * header tuple, the point messages' count, the points list. */
#define HEADER_FIELDS 11
typedef struct {
    PyObject *header[HEADER_FIELDS];
    Py_ssize_t count;
    PyObject *points;
} Plain;

static void plain_clear(Plain *plain) {
    int i;
    for (i = 0; i < HEADER_FIELDS; i++) Py_CLEAR(plain->header[i]);
    Py_CLEAR(plain->points);
}

static int memory_envelope(const Slice *text, const int64_t *num, const unsigned char *s, Py_ssize_t n,
                           StrCache *cache, PyObject **out);

/* One Envelope: its fields in *out (0), a memory envelope's dict in *other (MEMORY), or NOT_PLAIN /
 * BAIL_RECORD / -3 (a Python error; *out then holds nothing). */
static int read_envelope(const unsigned char *s, Py_ssize_t n, StrCache *cache, Plain *out, PyObject **other) {
    Cursor c = {s, s + n};
    Slice str[F_STRINGS], sdk = {NULL, 0};
    uint64_t tag, v;
    int32_t pid = 0, rank = 0, world = 0, local_rank = 0, severity = 0, group_rank = 0;
    int64_t step = 0, time_ns = 0;
    const unsigned char *batch = NULL, *memory = NULL;
    Py_ssize_t batch_n = 0, memory_n = 0;
    int metrics_seen = 0, other_payload = 0, memory_seen = 0, other_kind = 0, i, rc;
    memset(str, 0, sizeof(str));
    while (c.p < c.end) {
        if (read_tag(&c, &tag) < 0) return BAIL_RECORD;
        unsigned field = (unsigned)(tag >> 3), wt = (unsigned)(tag & 7);
        int which = -1;
        switch (field) {
        case 1: which = F_EVENT_ID; break;
        case 2: which = F_PROJECT; break;
        case 3: which = F_RUN_ID; break;
        case 4: which = F_TRACE_ID; break;
        case 5: which = F_HOST; break;
        case 13: which = F_RUN_NAME; break;
        default: break;
        }
        if (which >= 0) {
            if ((rc = check_utf8(cache, str[which])) < 0) return rc; /* an earlier occurrence */
            if (wt != 2 || read_len(&c, &str[which].s, &str[which].n) < 0) return BAIL_RECORD;
            continue;
        }
        switch (field) {
        case 6: case 7: case 9: case 10: case 11:
            if (wt != 0 || read_varint(&c, &v) < 0) return BAIL_RECORD;
            if (field == 6) pid = (int32_t)(uint32_t)v;
            else if (field == 7) rank = (int32_t)(uint32_t)v;
            else if (field == 9) world = (int32_t)(uint32_t)v;
            else if (field == 10) step = (int64_t)v;
            else time_ns = (int64_t)v;
            break;
        case 8: case 12: case 15: /* local_rank, severity, group_rank: a memory envelope's dict only */
            if (wt != 0 || read_varint(&c, &v) < 0) return BAIL_RECORD;
            if (field == 8) local_rank = (int32_t)(uint32_t)v;
            else if (field == 12) severity = (int32_t)(uint32_t)v; /* an open enum: int32 */
            else group_rank = (int32_t)(uint32_t)v;
            break;
        case 14: /* sdk: not returned, but checked (UTF-8) as protobuf checks it */
            if (wt != 2 || read_len(&c, &sdk.s, &sdk.n) < 0) return BAIL_RECORD;
            if ((rc = check_utf8(cache, sdk)) < 0) return rc;
            break;
        case 20:
            if (wt != 2 || read_len(&c, &batch, &batch_n) < 0) return BAIL_RECORD;
            metrics_seen++;
            break;
        case 21: case 22: case 23: case 24:
            if (wt != 2 || skip_value(&c, wt) < 0) return BAIL_RECORD;
            other_payload = other_kind = 1;
            break;
        case 25:
            if (wt != 2 || read_len(&c, &memory, &memory_n) < 0) return BAIL_RECORD;
            other_payload = 1;
            memory_seen++;
            break;
        default:
            if (field == 0 || field <= 25 || skip_value(&c, wt) < 0) return BAIL_RECORD;
        }
    }
    /* plain: metrics is the payload, given once, and no other member of the oneof ever (a repeated message
     * field merges, a replaced member's bytes are still checked: protobuf's to read) */
    if (metrics_seen == 0 && memory_seen == 1 && !other_kind) { /* a memory envelope: its dict */
        Slice text[HEAD_FIELDS + 1];
        int64_t num[HEAD_FIELDS + 1];
        memset(text, 0, sizeof(text));
        memset(num, 0, sizeof(num));
        text[1] = str[F_EVENT_ID];
        text[2] = str[F_PROJECT];
        text[3] = str[F_RUN_ID];
        text[4] = str[F_TRACE_ID];
        text[5] = str[F_HOST];
        text[13] = str[F_RUN_NAME];
        text[14] = sdk;
        num[6] = pid;
        num[7] = rank;
        num[8] = local_rank;
        num[9] = world;
        num[10] = step;
        num[11] = time_ns;
        num[12] = severity;
        num[15] = group_rank;
        return memory_envelope(text, num, memory, memory_n, cache, other);
    }
    if (metrics_seen != 1 || other_payload || str[F_RUN_ID].n == 0) return NOT_PLAIN;
    {
        /* the batch: no alert, no recent point; its points */
        Cursor b = {batch, batch + batch_n};
        Py_ssize_t count = 0;
        PyObject *points, *step_obj, *o;
        const unsigned char *ps = NULL;
        Py_ssize_t pn = 0;
        int alert = 0;
        while (b.p < b.end) {
            if (read_tag(&b, &tag) < 0) return BAIL_RECORD;
            switch (tag) {
            case (1 << 3) | 2:
                if (read_len(&b, &ps, &pn) < 0) return BAIL_RECORD;
                count++;
                break;
            case (2 << 3) | 2:
                if (read_len(&b, &ps, &pn) < 0) return BAIL_RECORD;
                alert = pn > 0; /* the last occurrence is the value; each one is checked */
                {
                    Slice a = {ps, pn};
                    if ((rc = check_utf8(cache, a)) < 0) return rc;
                }
                break;
            case (3 << 3) | 2:
                return NOT_PLAIN; /* a recent point */
            default:
                if ((tag >> 3) >= 1 && (tag >> 3) <= 3) return BAIL_RECORD;
                if (tag >> 3 == 0 || skip_value(&b, (unsigned)(tag & 7)) < 0) return BAIL_RECORD;
            }
        }
        if (alert) return NOT_PLAIN;
        step_obj = PyLong_FromLongLong(step); /* the header's step, and each point's without its own */
        if (step_obj == NULL) return -3;
        points = PyList_New(0);
        if (points == NULL) {
            Py_DECREF(step_obj);
            return -3;
        }
        b.p = batch;
        while (b.p < b.end) { /* the bytes walked above (immutable: read() takes bytes only) */
            if (read_tag(&b, &tag) < 0) rc = BAIL_RECORD;
            else if (tag == ((1 << 3) | 2))
                rc = read_len(&b, &ps, &pn) < 0 ? BAIL_RECORD : read_point(ps, pn, step_obj, cache, points);
            else
                rc = skip_value(&b, (unsigned)(tag & 7)) < 0 ? BAIL_RECORD : 0;
            if (rc < 0) {
                Py_DECREF(points);
                Py_DECREF(step_obj);
                return rc;
            }
        }
        {
            static const int order[] = {F_EVENT_ID, F_PROJECT, F_RUN_ID, -1, -2, -3, F_HOST, -4, -5,
                                        F_RUN_NAME, F_TRACE_ID};
            memset(out, 0, sizeof(*out));
            for (i = 0; i < HEADER_FIELDS; i++) {
                int k = order[i];
                if (k >= 0) {
                    o = k == F_EVENT_ID ? PyUnicode_DecodeUTF8((const char *)str[k].s, str[k].n, "strict")
                                        : cached_str(cache, str[k]);
                } else if (k == -1) {
                    o = PyLong_FromLong(rank);
                } else if (k == -2) {
                    Py_INCREF(step_obj);
                    o = step_obj;
                } else if (k == -3) {
                    o = PyLong_FromLongLong(time_ns);
                } else if (k == -4) {
                    o = PyLong_FromLong(pid);
                } else {
                    o = PyLong_FromLong(world > 1 ? world : 1); /* the pipeline's world_size: at least 1 */
                }
                if (o == NULL) {
                    plain_clear(out);
                    Py_DECREF(points);
                    Py_DECREF(step_obj);
                    if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                        PyErr_Clear();
                        return BAIL_RECORD;
                    }
                    return -3;
                }
                out->header[i] = o;
            }
        }
        Py_DECREF(step_obj);
        out->count = count;
        out->points = points;
        return 0;
    }
}

/* What walk_request does with each envelope, in order: ``plain`` its fields (emit takes its references,
 * whatever it returns) or NULL when it is not a plain batch; ``other`` a memory envelope's dict (emit takes
 * the reference) or NULL; 0, or -1 with a Python error. */
typedef int (*EmitFn)(void *ctx, Py_ssize_t index, Plain *plain, PyObject *other);

/* Every envelope of the request ``arg`` read and handed to emit: 1 when read, 0 when the request must go to
 * protobuf (read()'s None), -1 on a Python error. */
static int walk_request(PyObject *arg, EmitFn emit, void *ctx) {
    Py_buffer view;
    Cursor c;
    StrCache cache;
    uint64_t tag;
    const unsigned char *es;
    Py_ssize_t en, index = 0;
    Plain plain;
    PyObject *other;
    int rc, result = 1;
    if (!PyBytes_CheckExact(arg)) return 0; /* bytes only (immutable while read): protobuf reads the rest */
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return -1;
    c.p = (const unsigned char *)view.buf;
    c.end = c.p + view.len;
    cache.count = 0;
    cache.empty = PyUnicode_FromStringAndSize("", 0);
    if (cache.empty == NULL) result = -1;
    while (result == 1 && c.p < c.end) {
        if (read_tag(&c, &tag) < 0) {
            result = 0;
            break;
        }
        if (tag != ((1 << 3) | 2)) {
            if ((tag >> 3) == 1 || tag >> 3 == 0 || skip_value(&c, (unsigned)(tag & 7)) < 0) result = 0;
            continue;
        }
        if (read_len(&c, &es, &en) < 0) {
            result = 0;
            break;
        }
        other = NULL;
        rc = read_envelope(es, en, &cache, &plain, &other);
        if (rc == BAIL_RECORD) result = 0;
        else if (rc == -3) result = -1;
        else if (emit(ctx, index++, rc == 0 ? &plain : NULL, rc == MEMORY ? other : NULL) < 0) result = -1;
    }
    cache_clear(&cache);
    Py_XDECREF(cache.empty);
    PyBuffer_Release(&view);
    return result;
}

/* read()'s row of an envelope appended to the list ctx */
static int emit_row(void *ctx, Py_ssize_t index, Plain *plain, PyObject *other) {
    PyObject *item, *header;
    int i, rc;
    (void)index;
    if (other != NULL) {
        rc = PyList_Append((PyObject *)ctx, other);
        Py_DECREF(other);
        return rc;
    }
    if (plain == NULL) return PyList_Append((PyObject *)ctx, Py_None);
    header = PyTuple_New(HEADER_FIELDS);
    if (header == NULL) {
        plain_clear(plain);
        return -1;
    }
    for (i = 0; i < HEADER_FIELDS; i++) {
        PyTuple_SET_ITEM(header, i, plain->header[i]);
        plain->header[i] = NULL;
    }
    item = Py_BuildValue("(NnN)", header, plain->count, plain->points); /* steals header and points */
    plain->points = NULL;
    if (item == NULL) return -1;
    rc = PyList_Append((PyObject *)ctx, item);
    Py_DECREF(item);
    return rc;
}

static PyObject *fastread_read(PyObject *self, PyObject *arg) {
    PyObject *result = PyList_New(0);
    int rc;
    (void)self;
    if (result == NULL) return NULL;
    rc = walk_request(arg, emit_row, result);
    if (rc == 1) return result;
    Py_DECREF(result);
    if (rc == 0) Py_RETURN_NONE;
    return NULL;
}

/* Whether every item of the list ``points`` is a (str, step, value) tuple: what add_points appends. */
static int points_ok(PyObject *points) {
    Py_ssize_t i, n = PyList_GET_SIZE(points);
    for (i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(points, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 3 ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(item, 0)))
            return 0;
    }
    return 1;
}

/* The points of the list ``points`` (points_ok) appended to ``by_name`` (an exact dict): the points added,
 * or -1 with a Python error. Allocating a series' lists may run the garbage collector, hence finalizers,
 * hence any Python code: the list and the dict are read again at each point and what is used is held. */
static Py_ssize_t append_points(PyObject *by_name, PyObject *time_ns, PyObject *points) {
    PyObject *item, *cols;
    Py_ssize_t i;
    int bad;
    for (i = 0; i < PyList_GET_SIZE(points); i++) {
        item = PyList_GET_ITEM(points, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 3 ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(item, 0))) {
            PyErr_SetString(PyExc_RuntimeError, "add_points: the points changed while being added");
            return -1;
        }
        Py_INCREF(item);
        cols = PyDict_GetItemWithError(by_name, PyTuple_GET_ITEM(item, 0)); /* str keys: no Python code */
        if (cols == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(item);
                return -1;
            }
            cols = Py_BuildValue("([][][])");
            if (cols == NULL || PyDict_SetItem(by_name, PyTuple_GET_ITEM(item, 0), cols) < 0) {
                Py_XDECREF(cols);
                Py_DECREF(item);
                return -1;
            }
        } else {
            Py_INCREF(cols);
        }
        bad = !PyTuple_CheckExact(cols) || PyTuple_GET_SIZE(cols) != 3 ||
              !PyList_CheckExact(PyTuple_GET_ITEM(cols, 0)) || !PyList_CheckExact(PyTuple_GET_ITEM(cols, 1)) ||
              !PyList_CheckExact(PyTuple_GET_ITEM(cols, 2));
        if (bad) {
            PyErr_SetString(PyExc_TypeError, "add_points: a series' columns are a tuple of three lists");
        } else {
            bad = PyList_Append(PyTuple_GET_ITEM(cols, 0), PyTuple_GET_ITEM(item, 1)) < 0 ||
                  PyList_Append(PyTuple_GET_ITEM(cols, 1), time_ns) < 0 ||
                  PyList_Append(PyTuple_GET_ITEM(cols, 2), PyTuple_GET_ITEM(item, 2)) < 0;
        }
        Py_DECREF(cols);
        Py_DECREF(item);
        if (bad) return -1;
    }
    return i; /* the points added (all of them unless the list shrank meanwhile) */
}

/* add_points(by_name, time_ns, points) -> int: storage.base.MetricColumns.add's loop for one envelope --
 * each (name, step, value) of ``points`` appended to ``by_name[name]``'s (steps, times, values) lists (a new
 * ([], [], []) for a new name), ``time_ns`` as the time of each; returns len(points). Every item must be a
 * tuple of three with a str name (what read() and decode build); TypeError otherwise, before anything is
 * added. */
static PyObject *fastread_add_points(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t added;
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_points(by_name, time_ns, points)");
        return NULL;
    }
    if (!PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "add_points: a dict and a list");
        return NULL;
    }
    if (!points_ok(args[2])) { /* nothing is added unless every point is a (str, step, value) tuple */
        PyErr_SetString(PyExc_TypeError, "add_points: every point a (name: str, step, value) tuple");
        return NULL;
    }
    added = append_points(args[0], args[1], args[2]);
    return added < 0 ? NULL : PyLong_FromSsize_t(added);
}

/* --- read_envelopes: read()'s plain batches as the objects decode.read_request hands out ------------------
 * setup(classes, slots) is given, by decode.py, the three classes (ReadEnvelope, PlainBatch, PlainEnvelope)
 * and for each the member descriptors of its __slots__ in the order of its __init__'s assignments
 * (ReadEnvelope: raw, kind, body, then the header fields in read()'s order; PlainBatch: _record, _index,
 * _dict, count; PlainEnvelope: _body, _msg). read_envelopes(value, record) then builds, for each plain batch,
 * what ``ReadEnvelope(PlainEnvelope(body), "metrics", body, *header)`` with ``body = PlainBatch(record,
 * index, count)`` builds -- each object allocated by its type and its slots set to those values, which is
 * all those __init__s do (decode.py checks the classes are the ones it knows; the tests compare every
 * object with the protobuf path's) -- without running Python code per envelope. */
#define RE_SLOTS 14
#define PB_SLOTS 4
#define PE_SLOTS 2
static PyTypeObject *re_type = NULL, *pb_type = NULL, *pe_type = NULL;
static Py_ssize_t re_off[RE_SLOTS], pb_off[PB_SLOTS], pe_off[PE_SLOTS];
static PyObject *kind_metrics = NULL;

static int slot_offsets(PyObject *type, PyObject *descrs, Py_ssize_t *out, Py_ssize_t n) {
    Py_ssize_t i;
    if (!PyType_Check(type) || !PyTuple_Check(descrs) || PyTuple_GET_SIZE(descrs) != n) return -1;
    for (i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(descrs, i);
        PyMemberDef *m;
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) return -1;
        if (((PyDescrObject *)d)->d_type != (PyTypeObject *)type) return -1;
        m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return -1;
        out[i] = m->offset;
    }
    return 0;
}

static PyObject *fastread_setup(PyObject *self, PyObject *args) {
    PyObject *re, *pb, *pe, *re_d, *pb_d, *pe_d;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOO", &re, &pb, &pe, &re_d, &pb_d, &pe_d)) return NULL;
    if (slot_offsets(re, re_d, re_off, RE_SLOTS) < 0 || slot_offsets(pb, pb_d, pb_off, PB_SLOTS) < 0 ||
        slot_offsets(pe, pe_d, pe_off, PE_SLOTS) < 0) {
        re_type = pb_type = pe_type = NULL;
        PyErr_SetString(PyExc_TypeError, "setup: a class or a slot is not what read_envelopes builds");
        return NULL;
    }
    if (kind_metrics == NULL) {
        kind_metrics = PyUnicode_InternFromString("metrics");
        if (kind_metrics == NULL) return NULL;
    }
    Py_INCREF(re);
    Py_INCREF(pb);
    Py_INCREF(pe);
    Py_XDECREF(re_type);
    Py_XDECREF(pb_type);
    Py_XDECREF(pe_type);
    re_type = (PyTypeObject *)re;
    pb_type = (PyTypeObject *)pb;
    pe_type = (PyTypeObject *)pe;
    Py_RETURN_NONE;
}

/* a new instance of type with its slots at off[] set to vals[] (new references taken) */
static PyObject *filled(PyTypeObject *type, const Py_ssize_t *off, PyObject **vals, Py_ssize_t n) {
    Py_ssize_t i;
    PyObject *obj = type->tp_alloc(type, 0);
    if (obj == NULL) return NULL;
    for (i = 0; i < n; i++) {
        Py_INCREF(vals[i]);
        *(PyObject **)((char *)obj + off[i]) = vals[i];
    }
    return obj;
}

/* read_envelopes(value, record) -> (envelopes, points, complete) | None: read()'s rows as objects -- for a
 * plain batch its ReadEnvelope and its points list, None and None for any other envelope (complete False
 * when there is one) -- or None where read() returns None. The objects are built from what read_envelope
 * read, with no row tuple between. */
typedef struct {
    PyObject *record, *envs, *pts;
    int complete;
} Built;

static int emit_objects(void *ctx, Py_ssize_t i, Plain *plain, PyObject *other) {
    Built *built = (Built *)ctx;
    PyObject *index, *body, *raw, *env, *count;
    PyObject *vals[RE_SLOTS];
    Py_ssize_t k;
    int rc;
    if (other != NULL) { /* a memory envelope: its dict, no points (not a metric batch) */
        rc = PyList_Append(built->envs, other);
        Py_DECREF(other);
        return rc < 0 ? -1 : PyList_Append(built->pts, Py_None);
    }
    if (plain == NULL) {
        built->complete = 0;
        if (PyList_Append(built->envs, Py_None) < 0) return -1;
        return PyList_Append(built->pts, Py_None);
    }
    env = NULL;
    index = PyLong_FromSsize_t(i);
    count = PyLong_FromSsize_t(plain->count);
    if (index != NULL && count != NULL) {
        vals[0] = built->record;
        vals[1] = index;
        vals[2] = Py_None;
        vals[3] = count;
        body = filled(pb_type, pb_off, vals, PB_SLOTS);
        if (body != NULL) {
            vals[0] = body;
            vals[1] = Py_None;
            raw = filled(pe_type, pe_off, vals, PE_SLOTS);
            if (raw != NULL) {
                vals[0] = raw;
                vals[1] = kind_metrics;
                vals[2] = body;
                for (k = 0; k < HEADER_FIELDS; k++) vals[3 + k] = plain->header[k];
                env = filled(re_type, re_off, vals, RE_SLOTS);
                Py_DECREF(raw);
            }
            Py_DECREF(body);
        }
    }
    Py_XDECREF(index);
    Py_XDECREF(count);
    rc = env == NULL ? -1 : PyList_Append(built->envs, env);
    Py_XDECREF(env);
    if (rc == 0) rc = PyList_Append(built->pts, plain->points);
    plain_clear(plain);
    return rc;
}

static PyObject *fastread_read_envelopes(PyObject *self, PyObject *args) {
    PyObject *value;
    Built built;
    int rc;
    (void)self;
    if (re_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "read_envelopes: setup() first");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO", &value, &built.record)) return NULL;
    built.complete = 1;
    built.envs = PyList_New(0);
    built.pts = PyList_New(0);
    rc = built.envs == NULL || built.pts == NULL ? -1 : walk_request(value, emit_objects, &built);
    if (rc == 1) return Py_BuildValue("(NNO)", built.envs, built.pts, built.complete ? Py_True : Py_False);
    Py_XDECREF(built.envs);
    Py_XDECREF(built.pts);
    if (rc == 0) Py_RETURN_NONE;
    return NULL;
}

/* add_read(by_rank, envelopes, points, start) -> (stop, added): MetricColumns.add_with(add_points, ...) of
 * each envelope from ``start`` on that the native reader's type built (exactly setup()'s ReadEnvelope, every
 * slot set) with a non-empty list of points that add_points takes -- the series of
 * ``by_rank[(project, run_id, rank)]`` (a new dict for a new key), its time ``time_ns`` --, one envelope
 * after the other; an envelope with no points (an empty list, None) adds nothing. Stops at the first
 * envelope it does not take (the caller handles that one as before, then calls again from the next):
 * ``stop`` is its index (len(envelopes) when none), ``added`` the points added before it. ``envelopes``
 * and ``points`` exact lists of one length, ``by_rank`` an exact dict; TypeError otherwise. */
enum { RE_PROJECT = 4, RE_RUN_ID = 5, RE_RANK = 6, RE_TIME_NS = 8 }; /* their index in re_off[] */
static PyObject *fastread_add_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *by_rank, *envs, *pts;
    Py_ssize_t i, start, added = 0;
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "add_read(by_rank, envelopes, points, start)");
        return NULL;
    }
    by_rank = args[0];
    envs = args[1];
    pts = args[2];
    start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    if (!PyDict_CheckExact(by_rank) || !PyList_CheckExact(envs) || !PyList_CheckExact(pts) ||
        PyList_GET_SIZE(envs) != PyList_GET_SIZE(pts) || start < 0) {
        PyErr_SetString(PyExc_TypeError, "add_read: a dict, two lists of one length and an index");
        return NULL;
    }
    if (re_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "add_read: setup() first");
        return NULL;
    }
    /* the lists are read again at each envelope (appending may run Python code: append_points) */
    for (i = start; i < PyList_GET_SIZE(envs) && i < PyList_GET_SIZE(pts); i++) {
        PyObject *env = PyList_GET_ITEM(envs, i), *mine = PyList_GET_ITEM(pts, i);
        PyObject *project, *run_id, *rank, *time_ns, *key, *by_name;
        Py_ssize_t got;
        if (Py_TYPE(env) != re_type) break;
        if (mine == Py_None || (PyList_CheckExact(mine) && PyList_GET_SIZE(mine) == 0)) continue;
        if (!PyList_CheckExact(mine) || !points_ok(mine)) break;
        project = *(PyObject **)((char *)env + re_off[RE_PROJECT]);
        run_id = *(PyObject **)((char *)env + re_off[RE_RUN_ID]);
        rank = *(PyObject **)((char *)env + re_off[RE_RANK]);
        time_ns = *(PyObject **)((char *)env + re_off[RE_TIME_NS]);
        if (project == NULL || run_id == NULL || rank == NULL || time_ns == NULL) break;
        Py_INCREF(env);
        Py_INCREF(mine);
        /* held: allocating below (the key first) may run Python code (a finalizer) that rebinds a slot */
        Py_INCREF(time_ns);
        Py_INCREF(project);
        Py_INCREF(run_id);
        Py_INCREF(rank);
        key = PyTuple_Pack(3, project, run_id, rank);
        Py_DECREF(project);
        Py_DECREF(run_id);
        Py_DECREF(rank);
        by_name = key == NULL ? NULL : PyDict_GetItemWithError(by_rank, key); /* may run __eq__/__hash__ */
        if (by_name != NULL) {
            Py_INCREF(by_name);
        } else if (key != NULL && !PyErr_Occurred()) {
            by_name = PyDict_New();
            if (by_name != NULL && PyDict_SetItem(by_rank, key, by_name) < 0) Py_CLEAR(by_name);
        }
        Py_XDECREF(key);
        got = -1;
        if (by_name != NULL) {
            if (PyDict_CheckExact(by_name) && PyList_CheckExact(mine) && points_ok(mine)) {
                got = append_points(by_name, time_ns, mine);
            } else {
                PyErr_SetString(PyExc_TypeError, "add_read: a rank's series are a dict");
            }
            Py_DECREF(by_name);
        }
        Py_DECREF(time_ns);
        Py_DECREF(mine);
        Py_DECREF(env);
        if (got < 0) return NULL;
        added += got;
    }
    return Py_BuildValue("(nn)", i, added);
}

static PyMethodDef methods[] = {
    {"setup", fastread_setup, METH_VARARGS,
     "setup(ReadEnvelope, PlainBatch, PlainEnvelope, their slot descriptors x3): the classes read_envelopes builds."},
    {"read_envelopes", fastread_read_envelopes, METH_VARARGS,
     "read_envelopes(value, record) -> (envelopes, points, complete) | None (see the source)."},
    {"add_points", (PyCFunction)(void (*)(void))fastread_add_points, METH_FASTCALL,
     "add_points(by_name, time_ns, points) -> int: MetricColumns.add's loop for one envelope."},
    {"add_read", (PyCFunction)(void (*)(void))fastread_add_read, METH_FASTCALL,
     "add_read(by_rank, envelopes, points, start) -> (stop, added): add_points of the plain batches."},
    {"read", fastread_read, METH_O,
     "read(value) -> list | None: each envelope's plain-metric-batch tuple or None (see the source)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastread",
                                    "The processor's optional native reader of queue records.", -1, methods,
                                    NULL, NULL, NULL, NULL};

/* What decode.py's prepare_native requires (READER_VERSION there): a module built from an older source is
 * not used (protobuf path) -- raise it with every change of what read/read_envelopes/add_points do. */
#define READER_VERSION 7

PyMODINIT_FUNC PyInit__fastread(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (make_keys() < 0 || PyModule_AddIntConstant(m, "VERSION", READER_VERSION) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
