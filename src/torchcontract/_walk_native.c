/* The walk of ``_fqn._walk``, in C: the same copies of a module tree, in fewer instructions.
 *
 * ``walk(root)`` returns exactly what the Python walk (``_fqn._walk_in_python``) collects
 * for a tree whose root has children, as ``_snapshot``'s arguments: ``(modules, classes,
 * (structure, names, holes), forwards, ((counts, keys, ids), (buffer_counts, buffer_keys,
 * buffer_ids)))`` (``classes`` is the tuple of the modules' classes, read while each module
 * is at hand). A member dict of a subclass of dict (``nn.Sequential``'s ``del`` leaves an
 * ``OrderedDict``) is read as Python reads it: its ``len``, its iteration, its ``values()``.
 *
 * It returns None, and ``_fqn`` walks the tree in Python, wherever the Python walk takes a
 * path of its own or would raise: a module whose instance ``__dict__`` lacks one of the
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

/* The lists (and the dict of forwards) one walk fills, by position. */
enum {
    MODULE_LIST, CLASS_LIST, STRUCTURE, NAMES, HOLES, FORWARDS,
    COUNTS, KEYS, IDS, BUFFER_COUNTS, BUFFER_KEYS, BUFFER_IDS, COPIES
};
typedef PyObject *Copies[COPIES];

/* What a step answers: 0 done, -1 a Python error is set, 1 the Python walk must do it. */
enum { DONE = 0, FAILED = -1, IN_PYTHON = 1 };

static int append_size(PyObject *list, Py_ssize_t value) {
    PyObject *number = PyLong_FromSsize_t(value);
    if (number == NULL) return FAILED;
    int result = PyList_Append(list, number);
    Py_DECREF(number);
    return result;
}

/* ``len(mapping)``, as Python reads it. */
static Py_ssize_t size_of(PyObject *mapping) {
    return PyDict_CheckExact(mapping) ? PyDict_GET_SIZE(mapping) : PyObject_Size(mapping);
}

/* ``items`` (a list of keys or of values) appended to ``list``. */
static int extend(PyObject *list, PyObject *items) {
    Py_ssize_t end = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, end, end, items);
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

static int append_id(PyObject *ids, PyObject *value) {
    PyObject *id = PyLong_FromVoidPtr(value);
    if (id == NULL) return FAILED;
    int result = PyList_Append(ids, id);
    Py_DECREF(id);
    return result;
}

/* Each key of ``members`` into ``keys``, and the id of each value into ``ids``. */
static int copy_members(PyObject *members, PyObject *keys, PyObject *ids) {
    if (PyDict_CheckExact(members)) { /* no Python code runs in this loop */
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(members, &position, &key, &value)) {
            if (PyList_Append(keys, key) < 0 || append_id(ids, value) < 0) return FAILED;
        }
        return DONE;
    }
    PyObject *own_keys, *own_values;
    if (keys_and_values(members, &own_keys, &own_values) < 0) return FAILED;
    int result = extend(keys, own_keys) < 0 ? FAILED : DONE;
    Py_ssize_t count = PyList_GET_SIZE(own_values);
    for (Py_ssize_t index = 0; result == DONE && index < count; index++) {
        result = append_id(ids, PyList_GET_ITEM(own_values, index));
    }
    Py_DECREF(own_keys);
    Py_DECREF(own_values);
    return result;
}

/* Which of ``children`` (a list) are ``None``, as a tuple of booleans, with ``parent``. */
static int add_hole(PyObject **copies, PyObject *children, Py_ssize_t parent) {
    Py_ssize_t count = PyList_GET_SIZE(children);
    PyObject *absent = PyTuple_New(count);
    if (absent == NULL) return FAILED;
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *flag = PyList_GET_ITEM(children, index) == Py_None ? Py_True : Py_False;
        Py_INCREF(flag);
        PyTuple_SET_ITEM(absent, index, flag);
    }
    PyObject *hole = Py_BuildValue("(nN)", parent, absent);
    if (hole == NULL) return FAILED;
    int result = PyList_Append(copies[HOLES], hole);
    Py_DECREF(hole);
    return result;
}

static int visit(PyObject **copies, PyObject *children, Py_ssize_t parent, int depth);

/* ``attributes[name]``, a new reference, if it is a dict (or a subclass); else NULL, with
 * an error set if reading it raised. */
static PyObject *member(PyObject *attributes, PyObject *name) {
    PyObject *found = PyDict_GetItemWithError(attributes, name);
    if (found == NULL || !PyDict_Check(found)) return NULL;
    Py_INCREF(found);
    return found;
}

/* One child: its members copied, its own children visited. */
static int visit_child(PyObject **copies, PyObject *child, int depth) {
    PyObject *attributes = PyObject_GenericGetDict(child, NULL);
    if (attributes == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return FAILED;
        PyErr_Clear();
        return IN_PYTHON;
    }
    int result = IN_PYTHON;
    /* Held, not borrowed: code a dict subclass runs below may rebind them. */
    PyObject *parameters = NULL, *buffers = NULL, *grandchildren = NULL, *forward;
    Py_ssize_t position = PyList_GET_SIZE(copies[MODULE_LIST]), size;
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
    if (forward != NULL) {
        PyObject *key = PyLong_FromSsize_t(position);
        if (key == NULL) goto done;
        int stored = PyDict_SetItem(copies[FORWARDS], key, forward);
        Py_DECREF(key);
        if (stored < 0) goto done;
    } else if (PyErr_Occurred()) {
        goto done;
    }
    if (PyList_Append(copies[MODULE_LIST], child) < 0) goto done;
    if (PyList_Append(copies[CLASS_LIST], (PyObject *)Py_TYPE(child)) < 0) goto done;
    if ((size = size_of(parameters)) < 0 || append_size(copies[COUNTS], size) < 0) goto done;
    if (copy_members(parameters, copies[KEYS], copies[IDS]) < 0) goto done;
    if ((size = size_of(buffers)) < 0) goto done;
    if (size > 0) {
        if (append_size(copies[BUFFER_COUNTS], position) < 0) goto done;
        if (append_size(copies[BUFFER_COUNTS], size) < 0) goto done;
        if (copy_members(buffers, copies[BUFFER_KEYS], copies[BUFFER_IDS]) < 0) goto done;
    }
    if ((size = size_of(grandchildren)) < 0) goto done;
    result = size > 0 ? visit(copies, grandchildren, position, depth + 1) : DONE;
done:
    Py_XDECREF(parameters);
    Py_XDECREF(buffers);
    Py_XDECREF(grandchildren);
    Py_DECREF(attributes);
    return result;
}

/* ``children`` (a subclass of dict) read as Python reads it, into lists first. */
static int visit_lists(PyObject **copies, PyObject *children, Py_ssize_t parent, int depth) {
    PyObject *names, *values;
    if (keys_and_values(children, &names, &values) < 0) return FAILED;
    int result = extend(copies[NAMES], names) < 0 ? FAILED : DONE;
    Py_ssize_t count = PyList_GET_SIZE(values);
    for (Py_ssize_t index = 0; result == DONE && index < count; index++) {
        PyObject *child = PyList_GET_ITEM(values, index);
        result = child == Py_None ? add_hole(copies, values, parent)
                                  : visit_child(copies, child, depth);
    }
    Py_DECREF(names);
    Py_DECREF(values);
    return result;
}

/* ``children`` (an exact dict, held by the caller) without copying it: their names, then
 * each child in order. */
static int visit_dict(PyObject **copies, PyObject *children, Py_ssize_t parent, int depth) {
    Py_ssize_t size = PyDict_GET_SIZE(children), position = 0;
    PyObject *name, *child;
    while (PyDict_Next(children, &position, &name, &child)) {
        if (PyList_Append(copies[NAMES], name) < 0) return FAILED;
    }
    position = 0;
    while (PyDict_Next(children, &position, &name, &child)) {
        int result;
        if (child == Py_None) { /* rare: the children as a list, for the hole's flags */
            PyObject *values = PyDict_Values(children);
            if (values == NULL) return FAILED;
            result = add_hole(copies, values, parent);
            Py_DECREF(values);
        } else {
            Py_INCREF(child); /* held while visited: Python code below may drop it */
            result = visit_child(copies, child, depth);
            Py_DECREF(child);
        }
        if (result != DONE) return result;
        if (PyDict_GET_SIZE(children) != size) return IN_PYTHON; /* changed under the walk */
    }
    return DONE;
}

/* ``children`` of the module at ``parent``, ``depth`` levels below the root's. */
static int visit(PyObject **copies, PyObject *children, Py_ssize_t parent, int depth) {
    if (depth > MAX_DEPTH) return IN_PYTHON;
    Py_ssize_t size = size_of(children);
    if (size < 0) return FAILED;
    if (append_size(copies[STRUCTURE], parent) < 0) return FAILED;
    if (append_size(copies[STRUCTURE], size) < 0) return FAILED;
    Py_INCREF(children);
    int result = PyDict_CheckExact(children) ? visit_dict(copies, children, parent, depth)
                                             : visit_lists(copies, children, parent, depth);
    Py_DECREF(children);
    return result;
}

static PyObject *walk(PyObject *self, PyObject *root) {
    (void)self;
    Copies copies = {NULL};
    PyObject *start = NULL, *answer = NULL, *classes = NULL;
    int result;
    for (int index = 0; index < COPIES; index++) {
        copies[index] = index == FORWARDS ? PyDict_New() : PyList_New(0);
        if (copies[index] == NULL) goto done;
    }
    start = PyDict_New(); /* the walk's start: position -1, whose one child is the root */
    if (start == NULL || PyDict_SetItem(start, EMPTY, root) < 0) goto done;
    result = visit(copies, start, -1, 0);
    if (result == FAILED) goto done;
    if (result == IN_PYTHON) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    classes = PyList_AsTuple(copies[CLASS_LIST]);
    if (classes == NULL) goto done;
    /* N: each reference moves into the answer, made or not. */
    answer = Py_BuildValue(
        "(NN(NNN)N((NNN)(NNN)))", copies[MODULE_LIST], classes, copies[STRUCTURE],
        copies[NAMES], copies[HOLES], copies[FORWARDS], copies[COUNTS], copies[KEYS],
        copies[IDS], copies[BUFFER_COUNTS], copies[BUFFER_KEYS], copies[BUFFER_IDS]);
    for (int index = 0; index < COPIES; index++) {
        if (index != CLASS_LIST) copies[index] = NULL;
    }
done:
    Py_XDECREF(start);
    for (int index = 0; index < COPIES; index++) Py_XDECREF(copies[index]);
    return answer;
}

static PyMethodDef METHODS[] = {
    {"walk", walk, METH_O,
     "walk(root, /)\n--\n\nThe copies of _fqn's walk of root's tree, or None where the Python "
     "walk must take it."},
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
