/* The walk of ``_fqn._walk``, in C: the same copies of a module tree, in fewer instructions.
 *
 * ``walk(root)`` returns exactly what the Python walk (``_fqn._walk_in_python``) collects
 * for a tree whose root has children, as ``_snapshot``'s arguments: ``(modules, classes,
 * (structure, names, holes), forwards, ((counts, keys, ids), (buffer_counts, buffer_keys,
 * buffer_ids)))`` (``classes`` is the tuple of the modules' classes, read while each module
 * is at hand). A member dict of a subclass of dict (``nn.Sequential``'s ``del`` leaves an
 * ``OrderedDict``) is read as Python reads it: its ``len``, its iteration, its ``values()``.
 *
 * ``unchanged(root, copies)`` takes those copies, as a snapshot holds them, and walks the
 * tree comparing instead of copying: True if the walk would copy the same objects (the
 * same modules, classes, forwards, name and key strings, member objects by id), False at
 * the first difference, allocating next to nothing on the way (a key per forward, the
 * flags of a None child). False says only that something may
 * differ (an equal name in another string object, say): the caller then compares in full.
 *
 * Both return None, and ``_fqn`` walks the tree in Python, wherever the Python walk takes
 * a path of its own or would raise: a module whose instance ``__dict__`` lacks one of the
 * three member dicts (a traced module's), a member that is no dict, a tree deeper than
 * ``MAX_DEPTH`` (a cycle among them: the Python walk's RecursionError then names it), and
 * a dict of children that changed size while its children were walked (Python code a
 * dict subclass runs may change the tree; iterating it, Python raises). Code such a
 * subclass runs may then run again in the Python walk.
 *
 * Public C API only, under the GIL; every member dict is held while read; nothing is
 * cached between calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Deeper trees go to the Python walk, which raises where Python's recursion limit says.
 * Real models are a few dozen levels deep; this bounds the C stack the walk can use. */
#define MAX_DEPTH 256

static PyObject *PARAMETERS, *BUFFERS, *MODULES, *FORWARD, *EMPTY;

/* The lists a walk fills (or compares with), by position; the forwards are a dict. */
enum {
    MODULE_LIST, CLASS_LIST, STRUCTURE, NAMES, HOLES,
    COUNTS, KEYS, IDS, BUFFER_COUNTS, BUFFER_KEYS, BUFFER_IDS, LISTS
};

/* What a step answers: done; a Python error is set; the Python walk must do it; (when
 * comparing) the tree differs from the copies. */
enum { DONE = 0, FAILED = -1, IN_PYTHON = 1, DIFFERENT = 2 };

/* One walk: building copies (``comparing`` 0) or comparing with a snapshot's. */
typedef struct {
    int comparing;
    PyObject *lists[LISTS]; /* building: new lists; comparing: the snapshot's, held */
    PyObject *forwards;     /* a dict: the one being filled, or the snapshot's */
    Py_ssize_t read[LISTS]; /* comparing: how many items of each list were matched */
    Py_ssize_t forwards_read;
} Walk;

/* Put ``item`` next in ``list``: appended, or matched by identity. */
static int put(Walk *walk, int list, PyObject *item) {
    if (!walk->comparing) return PyList_Append(walk->lists[list], item);
    PyObject *expected = walk->lists[list];
    Py_ssize_t at = walk->read[list]++;
    /* The snapshot's lists and tuples: their items read in place, never resized here. */
    return at < PySequence_Fast_GET_SIZE(expected) &&
                   PySequence_Fast_ITEMS(expected)[at] == item
               ? DONE
               : DIFFERENT;
}

/* Put the integer ``value`` next in ``list`` (an ``id`` when ``pointer``). */
static int put_number(Walk *walk, int list, Py_ssize_t value, void *pointer) {
    if (walk->comparing) {
        PyObject *expected = walk->lists[list];
        Py_ssize_t at = walk->read[list]++;
        if (at >= PySequence_Fast_GET_SIZE(expected)) return DIFFERENT;
        PyObject *number = PySequence_Fast_ITEMS(expected)[at];
        if (!PyLong_Check(number)) return DIFFERENT;
        void *read = pointer ? PyLong_AsVoidPtr(number) : NULL;
        Py_ssize_t size = pointer ? 0 : PyLong_AsSsize_t(number);
        if ((pointer ? read == NULL : size == -1) && PyErr_Occurred()) {
            PyErr_Clear(); /* out of range: no copy of ours */
            return DIFFERENT;
        }
        return (pointer ? read == pointer : size == value) ? DONE : DIFFERENT;
    }
    PyObject *number = pointer ? PyLong_FromVoidPtr(pointer) : PyLong_FromSsize_t(value);
    if (number == NULL) return FAILED;
    int result = PyList_Append(walk->lists[list], number);
    Py_DECREF(number);
    return result;
}

static int put_size(Walk *walk, int list, Py_ssize_t value) {
    return put_number(walk, list, value, NULL);
}

static int put_id(Walk *walk, int list, PyObject *value) {
    return put_number(walk, list, 0, value);
}

/* Each of ``items`` (a list) put next in ``list``; ``ids``: their ids. */
static int put_each(Walk *walk, int list, PyObject *items, int ids) {
    Py_ssize_t count = PyList_GET_SIZE(items);
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *item = PyList_GET_ITEM(items, index);
        int result = ids ? put_id(walk, list, item) : put(walk, list, item);
        if (result != DONE) return result;
    }
    return DONE;
}

/* The module at ``position``'s instance ``forward``: stored, or matched by identity. */
static int put_forward(Walk *walk, Py_ssize_t position, PyObject *forward) {
    PyObject *key = PyLong_FromSsize_t(position);
    if (key == NULL) return FAILED;
    int result;
    if (walk->comparing) {
        PyObject *expected = PyDict_GetItemWithError(walk->forwards, key);
        result = expected == forward ? DONE : PyErr_Occurred() ? FAILED : DIFFERENT;
        walk->forwards_read++;
    } else {
        result = PyDict_SetItem(walk->forwards, key, forward);
    }
    Py_DECREF(key);
    return result;
}

/* ``len(mapping)``, as Python reads it. */
static Py_ssize_t size_of(PyObject *mapping) {
    return PyDict_CheckExact(mapping) ? PyDict_GET_SIZE(mapping) : PyObject_Size(mapping);
}

/* The keys and the values of ``mapping`` (a subclass of dict), as new lists in the order
 * Python iterates them: ``iter(mapping)`` and ``mapping.values()``. */
static int keys_and_values(PyObject *mapping, PyObject **keys, PyObject **values) {
    *values = NULL;
    *keys = PySequence_List(mapping);
    if (*keys == NULL) return FAILED;
    PyObject *view = PyObject_CallMethod(mapping, "values", NULL);
    if (view != NULL) {
        *values = PySequence_List(view);
        Py_DECREF(view);
    }
    if (*values != NULL) return DONE;
    Py_CLEAR(*keys);
    return FAILED;
}

/* Each key of ``members`` put in ``keys``, and the id of each value in ``ids``. */
static int put_members(Walk *walk, PyObject *members, int keys, int ids) {
    if (PyDict_CheckExact(members)) { /* no Python code runs in this loop */
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(members, &position, &key, &value)) {
            int result = put(walk, keys, key);
            if (result == DONE) result = put_id(walk, ids, value);
            if (result != DONE) return result;
        }
        return DONE;
    }
    PyObject *own_keys, *own_values;
    if (keys_and_values(members, &own_keys, &own_values) < 0) return FAILED;
    int result = put_each(walk, keys, own_keys, 0);
    if (result == DONE) result = put_each(walk, ids, own_values, 1);
    Py_DECREF(own_keys);
    Py_DECREF(own_values);
    return result;
}

/* Which of ``children`` (a list) are ``None``, as a tuple of booleans, with ``parent``. */
static int put_hole(Walk *walk, PyObject *children, Py_ssize_t parent) {
    Py_ssize_t count = PyList_GET_SIZE(children);
    PyObject *absent = PyTuple_New(count);
    if (absent == NULL) return FAILED;
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *flag = PyList_GET_ITEM(children, index) == Py_None ? Py_True : Py_False;
        PyTuple_SET_ITEM(absent, index, Py_NewRef(flag));
    }
    PyObject *hole = Py_BuildValue("(nN)", parent, absent);
    if (hole == NULL) return FAILED;
    int result;
    if (walk->comparing) { /* rare: compared by value */
        PyObject *expected = walk->lists[HOLES];
        Py_ssize_t at = walk->read[HOLES]++;
        result = at < PySequence_Fast_GET_SIZE(expected)
                     ? PyObject_RichCompareBool(PySequence_Fast_ITEMS(expected)[at], hole, Py_EQ)
                     : 0;
        result = result < 0 ? FAILED : result ? DONE : DIFFERENT;
    } else {
        result = PyList_Append(walk->lists[HOLES], hole);
    }
    Py_DECREF(hole);
    return result;
}

static int visit(Walk *walk, PyObject *children, Py_ssize_t parent, int depth);

/* ``attributes[name]``, a new reference, if it is a dict (or a subclass); else NULL, with
 * an error set if reading it raised. */
static PyObject *member(PyObject *attributes, PyObject *name) {
    PyObject *found = PyDict_GetItemWithError(attributes, name);
    if (found == NULL || !PyDict_Check(found)) return NULL;
    return Py_NewRef(found);
}

/* One child: its members put, its own children visited. */
static int visit_child(Walk *walk, PyObject *child, Py_ssize_t position, int depth) {
    PyObject *attributes = PyObject_GenericGetDict(child, NULL);
    if (attributes == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return FAILED;
        PyErr_Clear();
        return IN_PYTHON;
    }
    int result = IN_PYTHON;
    /* Held, not borrowed: code a dict subclass runs below may rebind them. */
    PyObject *parameters = NULL, *buffers = NULL, *grandchildren = NULL, *forward;
    Py_ssize_t size;
    if (!PyDict_CheckExact(attributes)) goto done;
    parameters = member(attributes, PARAMETERS);
    buffers = parameters ? member(attributes, BUFFERS) : NULL;
    grandchildren = buffers ? member(attributes, MODULES) : NULL;
    if (grandchildren == NULL) {
        result = PyErr_Occurred() ? FAILED : IN_PYTHON;
        goto done;
    }
    result = FAILED;
    forward = PyDict_GetItemWithError(attributes, FORWARD);
    if (forward == NULL && PyErr_Occurred()) goto done;
    if (forward != NULL && (result = put_forward(walk, position, forward)) != DONE) goto done;
    if ((result = put(walk, MODULE_LIST, child)) != DONE) goto done;
    if ((result = put(walk, CLASS_LIST, (PyObject *)Py_TYPE(child))) != DONE) goto done;
    result = FAILED;
    if ((size = size_of(parameters)) < 0) goto done;
    if ((result = put_size(walk, COUNTS, size)) != DONE) goto done;
    if ((result = put_members(walk, parameters, KEYS, IDS)) != DONE) goto done;
    result = FAILED;
    if ((size = size_of(buffers)) < 0) goto done;
    if (size > 0) {
        if ((result = put_size(walk, BUFFER_COUNTS, position)) != DONE) goto done;
        if ((result = put_size(walk, BUFFER_COUNTS, size)) != DONE) goto done;
        if ((result = put_members(walk, buffers, BUFFER_KEYS, BUFFER_IDS)) != DONE) goto done;
    }
    result = FAILED;
    if ((size = size_of(grandchildren)) < 0) goto done;
    result = size > 0 ? visit(walk, grandchildren, position, depth + 1) : DONE;
done:
    Py_XDECREF(parameters);
    Py_XDECREF(buffers);
    Py_XDECREF(grandchildren);
    Py_DECREF(attributes);
    return result;
}

/* The next module's position in pre-order: how many modules were put so far. */
static Py_ssize_t next_position(Walk *walk) {
    return walk->comparing ? walk->read[MODULE_LIST] : PyList_GET_SIZE(walk->lists[MODULE_LIST]);
}

/* ``children`` (a subclass of dict) read as Python reads it, into lists first. */
static int visit_lists(Walk *walk, PyObject *children, Py_ssize_t parent, int depth) {
    PyObject *names, *values;
    if (keys_and_values(children, &names, &values) < 0) return FAILED;
    int result = put_each(walk, NAMES, names, 0);
    Py_ssize_t count = PyList_GET_SIZE(values);
    for (Py_ssize_t index = 0; result == DONE && index < count; index++) {
        PyObject *child = PyList_GET_ITEM(values, index);
        result = child == Py_None ? put_hole(walk, values, parent)
                                  : visit_child(walk, child, next_position(walk), depth);
    }
    Py_DECREF(names);
    Py_DECREF(values);
    return result;
}

/* ``children`` (an exact dict, held by the caller) without copying it: their names, then
 * each child in order. */
static int visit_dict(Walk *walk, PyObject *children, Py_ssize_t parent, int depth) {
    Py_ssize_t size = PyDict_GET_SIZE(children), position = 0;
    PyObject *name, *child;
    while (PyDict_Next(children, &position, &name, &child)) {
        int result = put(walk, NAMES, name);
        if (result != DONE) return result;
    }
    position = 0;
    while (PyDict_Next(children, &position, &name, &child)) {
        int result;
        if (child == Py_None) { /* rare: the children as a list, for the hole's flags */
            PyObject *values = PyDict_Values(children);
            if (values == NULL) return FAILED;
            result = put_hole(walk, values, parent);
            Py_DECREF(values);
        } else {
            Py_INCREF(child); /* held while visited: Python code below may drop it */
            result = visit_child(walk, child, next_position(walk), depth);
            Py_DECREF(child);
        }
        if (result != DONE) return result;
        if (PyDict_GET_SIZE(children) != size) return IN_PYTHON; /* changed under the walk */
    }
    return DONE;
}

/* ``children`` of the module at ``parent``, ``depth`` levels below the root's. */
static int visit(Walk *walk, PyObject *children, Py_ssize_t parent, int depth) {
    if (depth > MAX_DEPTH) return IN_PYTHON;
    Py_ssize_t size = size_of(children);
    if (size < 0) return FAILED;
    int result = put_size(walk, STRUCTURE, parent);
    if (result == DONE) result = put_size(walk, STRUCTURE, size);
    if (result != DONE) return result;
    Py_INCREF(children);
    result = PyDict_CheckExact(children) ? visit_dict(walk, children, parent, depth)
                                         : visit_lists(walk, children, parent, depth);
    Py_DECREF(children);
    return result;
}

/* The walk of ``root`` from its start: position -1, whose one child is the root. */
static int walk_from(Walk *walk, PyObject *root) {
    PyObject *start = PyDict_New();
    if (start == NULL) return FAILED;
    int result = PyDict_SetItem(start, EMPTY, root) < 0 ? FAILED : visit(walk, start, -1, 0);
    Py_DECREF(start);
    return result;
}

static void release(Walk *walk) {
    for (int index = 0; index < LISTS; index++) Py_CLEAR(walk->lists[index]);
    Py_CLEAR(walk->forwards);
}

static PyObject *walk(PyObject *self, PyObject *root) {
    (void)self;
    Walk walk = {0};
    PyObject *answer = NULL, *classes = NULL, **lists = walk.lists;
    int result;
    for (int index = 0; index < LISTS; index++) {
        if ((walk.lists[index] = PyList_New(0)) == NULL) goto done;
    }
    if ((walk.forwards = PyDict_New()) == NULL) goto done;
    result = walk_from(&walk, root);
    if (result == FAILED) goto done;
    if (result == IN_PYTHON) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    if ((classes = PyList_AsTuple(lists[CLASS_LIST])) == NULL) goto done;
    answer = Py_BuildValue(
        "(ON(OOO)O((OOO)(OOO)))", lists[MODULE_LIST], classes, lists[STRUCTURE], lists[NAMES],
        lists[HOLES], walk.forwards, lists[COUNTS], lists[KEYS], lists[IDS],
        lists[BUFFER_COUNTS], lists[BUFFER_KEYS], lists[BUFFER_IDS]);
done:
    release(&walk);
    return answer;
}

/* The snapshot's lists, in ``walk``'s order, each as a list or tuple (held); 0, or -1 with
 * a TypeError if the copies are not shaped as ``walk`` returns them. */
static int read_copies(Walk *walk, PyObject *copies) {
    PyObject *modules, *classes, *structure, *names, *holes, *forwards;
    PyObject *counts, *keys, *ids, *buffer_counts, *buffer_keys, *buffer_ids;
    if (!PyTuple_Check(copies)) {
        PyErr_SetString(PyExc_TypeError, "unchanged() takes the copies walk() returns");
        return FAILED;
    }
    if (!PyArg_ParseTuple(
            copies, "OO(OOO)O!((OOO)(OOO));unchanged() takes the copies walk() returns",
            &modules, &classes, &structure, &names, &holes, &PyDict_Type, &forwards, &counts,
            &keys, &ids, &buffer_counts, &buffer_keys, &buffer_ids))
        return FAILED;
    PyObject *given[LISTS] = {modules, classes, structure, names, holes, counts,
                              keys, ids, buffer_counts, buffer_keys, buffer_ids};
    for (int index = 0; index < LISTS; index++) {
        walk->lists[index] = PySequence_Fast(given[index], "a copy must be a list or tuple");
        if (walk->lists[index] == NULL) return FAILED;
    }
    walk->forwards = Py_NewRef(forwards);
    return DONE;
}

static PyObject *unchanged(PyObject *self, PyObject *const *args, Py_ssize_t count) {
    (void)self;
    if (count != 2) {
        PyErr_SetString(PyExc_TypeError, "unchanged(root, copies) takes 2 arguments");
        return NULL;
    }
    Walk walk = {0};
    walk.comparing = 1;
    PyObject *answer = NULL;
    int result;
    if (read_copies(&walk, args[1]) < 0) goto done;
    result = walk_from(&walk, args[0]);
    if (result == DONE) { /* every copy matched; was any left over? */
        for (int index = 0; index < LISTS; index++) {
            if (walk.read[index] != PySequence_Fast_GET_SIZE(walk.lists[index]))
                result = DIFFERENT;
        }
        if (walk.forwards_read != PyDict_GET_SIZE(walk.forwards)) result = DIFFERENT;
    }
    if (result != FAILED)
        answer = Py_NewRef(result == IN_PYTHON ? Py_None : result == DONE ? Py_True : Py_False);
done:
    release(&walk);
    return answer;
}

static PyMethodDef METHODS[] = {
    {"walk", walk, METH_O,
     "walk(root, /)\n--\n\nThe copies of _fqn's walk of root's tree, or None where the Python "
     "walk must take it."},
    {"unchanged", (PyCFunction)(void (*)(void))unchanged, METH_FASTCALL,
     "unchanged(root, copies, /)\n--\n\nWhether a walk of root would copy the very objects "
     "of copies (walk's answer); None where the Python walk must take it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "torchcontract._walk_native",
    "The walk of _fqn in C: the same copies of a module tree, faster.", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

static int intern(PyObject **name, const char *text) {
    if (*name == NULL) *name = PyUnicode_InternFromString(text); /* once per process */
    return *name == NULL ? FAILED : DONE;
}

PyMODINIT_FUNC PyInit__walk_native(void) {
    if (intern(&PARAMETERS, "_parameters") < 0 || intern(&BUFFERS, "_buffers") < 0 ||
        intern(&MODULES, "_modules") < 0 || intern(&FORWARD, "forward") < 0 ||
        intern(&EMPTY, "") < 0)
        return NULL;
    return PyModule_Create(&MODULE);
}
