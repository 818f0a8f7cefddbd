using System.Diagnostics;

namespace ExactlyOnce.TestHost;

/// <summary>Polls a condition with a bounded deadline instead of sleeping a fixed time.</summary>
public static class Eventually
{
    public static async Task AssertAsync(Func<Task<bool>> condition, string because, TimeSpan? timeout = null)
    {
        var deadline = Stopwatch.StartNew();
        TimeSpan limit = timeout ?? TimeSpan.FromSeconds(30);
        while (true)
        {
            if (await condition())
            {
                return;
            }

            if (deadline.Elapsed > limit)
            {
                throw new TimeoutException($"Not reached within {limit}: {because}");
            }

            await Task.Delay(25);
        }
    }
}
